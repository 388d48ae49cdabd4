"""The QPARAMS document typed: :class:`QParamsDocument`, its options
(:class:`CalibrationRecord`) and one :class:`QParamsRecord` per tensor, field for field the
schema of ``profiler/schemas/qparams.schema.json`` (which allows no other keys, nor do these
records)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from rangeprof.profiler.profiling.records import ModelInfo
from rangeprof.profiler.records import Number, Record

from .methods import CHOICES, DTYPES, GRANULARITIES, METHODS, SCHEMES

Scheme = Literal[SCHEMES]
Dtype = Literal[tuple(DTYPES)]
Granularity = Literal[GRANULARITIES]
IMPORTED = "qdq"  # the method of qparams read from a QDQ model's pairs


class WeightCalibration(Record):
    """The options of weights and other static tensors, where a target's differ."""

    method: Literal["max"]
    scheme: Scheme
    dtype: Dtype
    granularity: Granularity
    power_of_two: bool


class CalibrationRecord(Record):
    """The options the qparams were derived with (a build's manifest copies them)."""

    method: Literal[(*CHOICES, IMPORTED)]
    percentile: Number
    scheme: Scheme
    dtype: Dtype
    granularity: Granularity
    power_of_two: bool
    target: Literal["x86", "aarch64", "npu"] | None = None
    weights: WeightCalibration | None = None


class QParamsRecord(Record):
    """One tensor's scale and zero point: numbers per tensor, lists per channel (``axis``)."""

    profile_id: str
    source_tensor: str | None
    kind: Literal["activation", "weight", "input"]
    dtype: Dtype
    method: Literal[(*METHODS, IMPORTED)]
    scale: Number | list[Number]
    zero_point: int | list[int]
    axis: int | None
    range: list[Number] | list[list[Number]]
    note: str | None


class DenseInputRecord(Record):
    """The stored statistics of a tensor dense layers read, copied from the profile: each
    channel's range along the last axis (null: no finite value), the mean square and the values
    per channel they were seen on (:class:`~.smoothing.DenseInput`)."""

    min: list[Number | None]
    max: list[Number | None]
    mean_square: Number
    samples: int


class MomentsRecord(Record):
    """An activation's mean and standard deviation, copied from the profile."""

    mean: Number
    std: Number


class QParamsDocument(Record):
    """Quantization parameters by profileID (``rangeprof calibrate``, ``import-qparams``). A
    file (:meth:`from_json` of a path) is checked against the schema first."""

    schema_version: Literal["1.0", "1.1", "1.2", "1.3", "1.4", "1.5"]
    model: ModelInfo
    options: CalibrationRecord
    qparams: list[QParamsRecord]
    dense_inputs: dict[str, DenseInputRecord] | None = None
    moments: dict[str, MomentsRecord] | None = None

    @classmethod
    def read(cls, path: Path) -> dict:
        from .methods import read_qparams

        return read_qparams(path)

    def __getitem__(self, profile_id: str) -> QParamsRecord:
        for record in self.qparams:
            if record.profile_id == profile_id:
                return record
        raise KeyError(profile_id)
