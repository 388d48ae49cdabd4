"""Write docs/cli.md, the CLI reference, from the CLI itself: every command's ``--help``.

    python docs/gen_cli.py           # rewrite docs/cli.md
    python docs/gen_cli.py --check   # exit 1 if docs/cli.md is not what the CLI says

``tests/test_docs.py`` runs the check, so a changed option or help text without the page
regenerated fails the tests. The help is click's plain rendering at a fixed width (not the
terminal's rich boxes), so the page does not depend on who generates it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import typer.core
import typer.main

PAGE = Path(__file__).with_name("cli.md")
WIDTH = 100

HEADER = """\
# CLI reference

Generated from the CLI by `python docs/gen_cli.py` (`tests/test_docs.py` fails when this page
is stale). Every option of `profile`, `calibrate`, `export`, `build` and `evaluate` is a field
of `rangeprof/workflows/options.py`, with the same default in the Python API and the REST API.
A user error prints one line `error: …` on stderr and exits with code 2; `--json` output goes
to stdout alone. Progress goes to stderr: a bar on a terminal, plain lines in a pipe or a log.

The commands `serve`, `worker`, `cancel`, `db` and `token` need the `service` extra
(`pip install 'rangeprof[service]'`); without it they say so. Start with the
[README](../README.md)'s tour; the pages on [accuracy](accuracy.md), [formats](formats.md) and
the [service](service.md) explain the options at length.
"""


def _context(command, name: str, parent=None):
    # The command's own context class: typer carries its own copy of click.
    return command.context_class(
        command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH
    )


def _commands(group, context):
    """``(context, command)`` of every command under ``group``, depth first, in CLI order."""
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        child = _context(command, name, context)
        yield child, command
        if hasattr(command, "list_commands"):  # a group: its commands follow it
            yield from _commands(command, child)


def render() -> str:
    """The page: a section per command, its plain ``--help`` text."""
    # Plain click help, not rich's boxes: stable across terminals and readable as Markdown.
    typer.core.HAS_RICH = False
    from rangeprof.cli import app

    root = typer.main.get_command(app)
    context = _context(root, "rangeprof")
    sections = [HEADER, "```text\n" + root.get_help(context) + "\n```\n"]
    for child, command in _commands(root, context):
        sections.append(f"## `{child.command_path}`\n\n```text\n{command.get_help(child)}\n```\n")
    return "\n".join(sections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    page = render()
    if args.check:
        if PAGE.read_text() != page:
            sys.exit(f"{PAGE} is stale: run python docs/gen_cli.py")
        return
    PAGE.write_text(page)


if __name__ == "__main__":
    main()
