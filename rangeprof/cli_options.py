"""The CLI's options made from the option groups (:mod:`rangeprof.workflows.options`): each
field becomes ``--field-name`` with the field's default and help, so a command offers exactly
what the Python API and the REST API offer. Values are checked by the workflow request the
command builds, which names the option in its one-line error."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo


def with_options(*groups: type[BaseModel], skip: tuple[str, ...] = ()) -> Callable:
    """Decorate a command to take every field of ``groups`` (but ``skip``) as an option; the
    command receives their values as ``options``, a dict by field name."""
    fields: dict[str, FieldInfo] = {}
    for group in groups:
        for name, info in group.model_fields.items():
            if name not in skip:
                fields.setdefault(name, info)

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "options"]
        added = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=_default(info),
                annotation=_typed(name, info),
            )
            for name, info in fields.items()
        ]

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            options = {name: _value(values.pop(name), info) for name, info in fields.items()}
            return command(**values, options=options)

        run.__signature__ = signature.replace(parameters=[*own, *added])
        return run

    return decorate


def _choices(annotation: Any) -> tuple | None:
    """The values of a ``Literal`` annotation (also inside ``X | None``)."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    literals = [a for a in typing.get_args(annotation) if typing.get_origin(a) is Literal]
    return tuple(v for a in literals for v in typing.get_args(a)) or None


def _optional(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(
        None
    ) in typing.get_args(annotation)


def _typed(name: str, info: FieldInfo) -> Any:
    """The option's annotation for typer: choices as text (the request checks them, naming
    the option in one line), a tuple as a repeatable option."""
    annotation = info.annotation
    choices = _choices(annotation)
    if choices is not None:
        kind = type(choices[0])
        base = kind | None if _optional(annotation) else kind
    elif typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        if typing.get_origin(item) is Annotated:  # the request checks the item, not typer
            item = typing.get_args(item)[0]
        base = list[item] | None
    else:
        base = annotation
    help_text = info.description or ""
    if choices is not None:
        help_text += f" One of: {', '.join(map(str, choices))}."
    if base in (bool, bool | None):
        flag = name.replace("_", "-")
        option = typer.Option(f"--{flag}/--no-{flag}", help=help_text)
    elif typing.get_origin(annotation) is tuple:
        option = typer.Option(f"--{name.replace('_', '-')}", help=help_text + " Repeatable.")
    else:
        option = typer.Option(f"--{name.replace('_', '-')}", help=help_text)
    return Annotated[base, option]


def _default(info: FieldInfo) -> Any:
    default = info.get_default(call_default_factory=True)
    return None if isinstance(default, tuple) and not default else default


def _value(value: Any, info: FieldInfo) -> Any:
    """A repeatable option's list as the field's tuple (none given: the field's default)."""
    if isinstance(value, list):
        return tuple(value)
    return info.get_default(call_default_factory=True) if value is None else value
