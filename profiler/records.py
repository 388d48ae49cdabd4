"""Typed records of the documents the pipeline writes: what every result class shares.

A record is a pydantic model of one JSON document (the profile, the QPARAMS document, a build's
manifest, an evaluation report) or of a part of one. Its fields are declared in the document's
key order, and fields a document holds only sometimes stay unset, so a record read from a
document gives that document back exactly: ``Record.from_json(doc).to_json() == doc``, and
:meth:`Record.dumps` is the text ``rangeprof`` writes."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError
from typing_extensions import Self

from rangeprof.profiler.errors import RangeprofError

# A JSON number as written: an integer stays an integer (a float field would make 0 of 0.0).
Number = int | float


class Record(BaseModel):
    """A document, or a part of one; an unknown key is an error unless a subclass's schema
    allows more."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def read(cls, path: Path) -> dict:
        """The document in the file at ``path``: a subclass with a JSON schema checks it."""
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise RangeprofError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RangeprofError(f"{path}: not a JSON document ({err})") from None

    @classmethod
    def from_json(cls, source: dict | str | Path) -> Self:
        """The record of a document: a dict, JSON text (a string starting with ``{``), or the
        path of a file (read with :meth:`read`)."""
        if isinstance(source, str) and source.lstrip().startswith("{"):
            try:
                source = json.loads(source)
            except json.JSONDecodeError as err:
                raise RangeprofError(f"not a JSON document ({err})") from None
        where = cls.__name__
        if not isinstance(source, dict):
            where = str(source)
            source = cls.read(Path(source))
        try:
            return cls.model_validate(source)
        except ValidationError as err:
            first = err.errors()[0]
            at = "/".join(str(part) for part in first["loc"]) or "top level"
            raise RangeprofError(f"{where}: invalid at {at}: {first['msg']}") from None

    def to_json(self) -> dict:
        """The document: the keys it was read with, in its order."""
        return self.model_dump(exclude_unset=True)

    def dumps(self) -> str:
        """The document's text, as ``rangeprof`` writes it."""
        return json.dumps(self.to_json(), indent=1)
