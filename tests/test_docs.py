"""The documentation holds: every shell block of the README and docs/ runs (marker ``docs``), and
in the default run the CLI reference is current, the README stays a front door, no page holds a
date, every relative link resolves and no command hides in an unrun block.

The conventions (docs/development.md): ```` ```sh ```` blocks run in order, per page, in a
temporary folder whose ``../shared`` is the shared models and data; a block whose info string
names a file (```` ```python file=tour.py ````) is written to that file there first;
```` ```sh-setup ```` blocks (installs) and ```` ```text ```` blocks are not run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SHARED

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN, SETUP = "sh", "sh-setup"
# Shell tags other than ours: a block so tagged would be neither run nor knowingly skipped.
UNRUN_SHELLS = {"bash", "shell", "console", "zsh", "shell-session", "sh-session", "shellsession"}
README_LIMIT = 12 * 1024
BLOCK_TIMEOUT_S = 900  # a hung block (a server never up) fails instead of stalling the run

_FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")
_DATE = re.compile(
    r"\b(19|20)\d\d-[01]\d-[0-3]\d\b|\b(January|February|March|April|May|June|July|August"
    r"|September|October|November|December) (\d{1,2}, )?(19|20)\d\d\b"
)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A repository path in inline code (`profiler/ir/stages.py`): a page's pointer into the code.
_PATH = re.compile(
    r"`((?:profiler|byoc_plugins|api|rangeprof|migrations|tests|benchmarks|docker|docs|\.ci)/[\w./-]*)`"
)


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page: its tag, the file it names, its text."""

    page: Path
    line: int  # of the opening fence, 1-based
    tag: str
    file: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page``, in order; indented fences (in list items) too."""
    found, lines, k = [], page.read_text().splitlines(), 0
    while k < len(lines):
        opening = _FENCE.match(lines[k])
        if not opening:
            k += 1
            continue
        start = k + 1
        indent, fence, info = opening.groups()
        words = info.split()
        tag = words[0] if words else ""
        file = next((w.removeprefix("file=") for w in words[1:] if w.startswith("file=")), None)
        body, k = [], k + 1
        while k < len(lines) and lines[k].strip() != fence:
            body.append(lines[k].removeprefix(indent))
            k += 1
        found.append(Block(page, start, tag, file, "\n".join(body) + "\n"))
        k += 1
    return found


def prose(page: Path) -> list[str]:
    """The lines of ``page`` outside fenced code blocks."""
    kept, inside = [], None
    for line in page.read_text().splitlines():
        fence = _FENCE.match(line)
        if inside is None and fence:
            inside = fence.group(2)
        elif inside is not None and line.strip() == inside:
            inside = None
        elif inside is None:
            kept.append(line)
    return kept


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The ``#anchors`` of ``page``'s headings (a repeated heading's get ``-1``, ``-2``…)."""
    found: set[str] = set()
    for line in prose(page):
        if match := re.match(r"^#{1,6} (.+)$", line):
            slug, n = _slug(match.group(1)), 0
            while (f"{slug}-{n}" if n else slug) in found:
                n += 1
            found.add(f"{slug}-{n}" if n else slug)
    return found


def _runnable(page: Path) -> bool:
    return any(block.tag == RUN for block in blocks(page))


def _stop(process: subprocess.Popen) -> None:
    """Stop what a block left running in its process group (a server it did not stop)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)


@pytest.mark.docs
@pytest.mark.parametrize(
    "page", [p for p in PAGES if _runnable(p)], ids=lambda p: str(p.relative_to(REPO))
)
def test_every_shell_block_runs(page, tmp_path):
    if not SHARED.is_dir():
        pytest.skip(f"the shared models and data are not available ({SHARED})")
    (tmp_path / "shared").symlink_to(SHARED)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        # The service's blocks use a database of their own, not the user's.
        "RANGEPROF_DB": f"sqlite:///{tmp_path / 'rangeprof.db'}",
        "RANGEPROF_STORAGE": str(tmp_path / "blobs"),
    }
    for block in blocks(page):
        if block.file:
            (work / block.file).write_text(block.text)
            continue
        if block.tag != RUN:
            continue
        process = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", block.text],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = process.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(process)
            out, err = process.communicate()
        finally:
            _stop(process)
        assert process.returncode == 0, (
            f"{block.where}: exit code {process.returncode}\n{block.text}\n"
            f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
        )


def test_cli_reference_is_current():
    # A process of its own: rendering switches typer's help to plain text.
    check = subprocess.run(
        [sys.executable, str(REPO / "docs" / "gen_cli.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr


def test_the_readme_is_a_front_door():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes: move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_holds_a_date(page):
    dated = [
        f"{page.name}:{n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if _DATE.search(line)
    ]
    assert dated == [], "history is git's"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for line in prose(page):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{target}: no {linked}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_a_page_names_exists(page):
    # Code moves: a page pointing at a file that is gone is stale.
    named = {path for line in prose(page) for path in _PATH.findall(line) if "*" not in path}
    assert sorted(path for path in named if not (REPO / path).exists()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_command_hides_from_the_doc_test(page):
    found = blocks(page)
    hidden = [b.where for b in found if b.tag in UNRUN_SHELLS]
    assert hidden == [], "tag shell blocks sh (run), sh-setup (installs) or text (shown)"
    # What a set-up line runs after its install runs in a block of the page too.
    ran = "".join(b.text for b in found if b.tag == RUN)
    for block in (b for b in found if b.tag == SETUP):
        for line in block.text.splitlines():
            _, chained, command = line.partition("&& ")
            if chained and command.startswith("rangeprof "):
                assert command in ran, f"{block.where}: {command!r} runs in no sh block"
