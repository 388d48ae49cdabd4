"""The profile document typed: :class:`ProfileDocument` and its parts (:class:`ModelInfo`,
:class:`RunInfo`, :class:`TensorEntry`), field for field the schema of
``profiler/schemas/profile.schema.json`` (:mod:`.document` says what the fields mean).

The schema allows keys it does not name, so these records keep unknown ones: a profile written
by another version loads, and writes back unchanged. Histogram counts (a 2048-bin histogram per
tensor) are validated as integers in strict mode: a profile of hundreds of tensors loads in
milliseconds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict

from rangeprof.profiler.ir.fates import FateText
from rangeprof.profiler.records import Number, Record


class _Open(Record):
    """A part of the profile document: the schema allows keys it does not name."""

    model_config = ConfigDict(extra="allow")


class ModelInfo(_Open):
    """The profiled model (the QPARAMS document copies it)."""

    name: str
    sha256: str
    opset: int | None = None
    inputs: dict[str, list[int]]
    bound_inputs: dict[str, Any] | None = None
    transforms: list[str] | None = None


class RunOptions(_Open):
    """The profiling options the run used."""

    bins: int
    batch_size: int
    samples: int | None = None
    seed: int = 0
    constant_inputs: list[str] = Field(default_factory=list)
    equalize: bool = False
    channel_stats: bool = False
    allow_nonfinite: bool = False
    cast: bool = False


class Distributed(_Open):
    engine: Literal["ray"]
    workers: int
    shards: int
    shards_on_restarted_workers: int


class RunInfo(_Open):
    """How the data went through the model: samples, options, timings."""

    samples: int
    batches: int | None = None
    data: str | None = None
    options: RunOptions
    build_cache: Literal["hit", "miss"] | None = None
    timings: dict[str, Number]
    tvm_version: str | None = None
    distributed: Distributed | None = None


class Moments(_Open):
    sum: str
    sum_sq: str
    unit_exponent: int


class HistogramRecord(_Open):
    bins: int
    exponent: int
    offset: int
    lo: Number
    hi: Number
    counts: Annotated[list[int], Strict()]


class ChannelSums(_Open):
    values: list[str]
    unit_exponent: int


class PerChannel(_Open):
    axis: int
    min: list[Number | None]
    max: list[Number | None]
    mean: list[Number | None] | None = None
    count: list[int] | None = None
    sum: ChannelSums | None = None


class TensorEntry(_Open):
    """One profiled tensor: its identity and its statistics
    (:class:`~rangeprof.profiler.profiling.statistics.TensorStats` reads them)."""

    profile_id: str
    source_node: str | None
    source_op: str | None = None
    source_tensor: str | None
    kind: Literal["activation", "weight", "input"]
    op: str | None = None
    shape: list[int] | None
    dtype: str
    static: bool
    graph_outputs: list[str] | None = None
    overflow: Literal[True] | None = None
    masked: Literal[True] | None = None
    nonfinite_inputs: list[str] | None = None
    nonfinite_origins: list[str] | None = None
    min: Number | None
    max: Number | None
    mean: Number | None
    std: Number | None
    count: int
    nan_count: int
    inf_count: int
    moments: Moments
    histogram: HistogramRecord | None
    per_channel: PerChannel | None


class StageReport(_Open):
    """One compiler stage: its counts, op histogram, lineage and fates."""

    name: str
    bindings: int
    tracked: int
    ops: dict[str, int]
    lineage: dict[str, list[str]]
    fates: dict[str, FateText]


class Lineage(_Open):
    fates: dict[str, FateText]
    stages: list[StageReport]


class ProfileDocument(_Open):
    """A profile: every tensor's statistics by profileID, with the model's lineage. A file
    (:meth:`from_json` of a path) is checked against the schema first, so its errors name
    the schema's path."""

    schema_version: Literal["1.0", "1.1", "1.2", "1.3"]
    model: ModelInfo
    run: RunInfo
    tensors: list[TensorEntry]
    lineage: Lineage = Field(description="Fates and stage reports of every profileID.")

    @classmethod
    def read(cls, path: Path) -> dict:
        from .document import load_profile

        return load_profile(path)

    def tensor(self, profile_id: str) -> TensorEntry:
        """The entry of ``profile_id`` (a :class:`KeyError` if there is none)."""
        for entry in self.tensors:
            if entry.profile_id == profile_id:
                return entry
        raise KeyError(profile_id)
