"""What became of a profileID (or an ONNX node) that no binding carries any more: its fate.

In documents a fate is the text ``<kind>:<target>`` (the profile's ``lineage.fates``, the
importer's and the ONNX loader's fates); :class:`Fate` is that text typed:

* ``folded_into:<key>``: what carried it now lives inside a later binding or node (a weight
  transposed at compile time, a folded batch-norm statistic);
* ``aliases:<profileID>``: it renames that value (an Identity);
* ``eliminated:constant`` / ``eliminated:dead``: it became a constant nobody consumes, or was
  dead code;
* ``qdq:<tensor>``: a QuantizeLinear / DequantizeLinear node of a QDQ model, whose pair gives
  that tensor's qparams.

Importable without TVM: reading a profile needs no compiler."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, PlainSerializer, WithJsonSchema

from rangeprof.profiler.records import Record

FOLDED_INTO, ALIASES, ELIMINATED, QDQ = "folded_into", "aliases", "eliminated", "qdq"
FateKind = Literal[FOLDED_INTO, ALIASES, ELIMINATED, QDQ]


class Fate(Record):
    """A fate: its ``kind`` and the ``target`` it names (what ``eliminated`` says of it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: FateKind
    target: str

    @classmethod
    def parse(cls, text: str) -> Fate:
        """The fate written ``text``."""
        kind, _, target = text.partition(":")
        return cls(kind=kind, target=target)

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}"


def _parsed(value):
    return Fate.parse(value) if isinstance(value, str) else value


# A fate field of a document: read from and written as its text.
FateText = Annotated[
    Fate,
    BeforeValidator(_parsed),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string"}),
]
