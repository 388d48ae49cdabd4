"""A job's peak memory and time per sample, estimated from its model's shapes before the job is
accepted: a run, evaluation or build whose estimated peak is over ``RANGEPROF_JOB_MEMORY_MB`` is
refused (422, naming the estimate and the limit), and so is one whose samples could not be done
within the job time limit even at a rate no host reaches. The job's process is held to the same
memory by an address-space limit (:mod:`rangeprof.service.execute`), so an estimate that falls
short fails one job with "memory limit", never the host.

The estimate is of the job process's peak address space, from the layers its upload recorded
(shapes and dtypes at the model's batch, scaled to the job's): its inputs, its largest
activation, its weights, its layer count (compiling) and a profile's histograms, each times the
copies of it alive at the peak. The copies were measured (``VmPeak`` of profiles, evaluations
and builds of the zoo's models and of single-tensor models up to 400 MB) and rounded up;
``benchmarks/job_memory.py`` prints estimate and measurement side by side.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from fastapi import HTTPException, status
from sqlalchemy import select

from .db import Database
from .execute import BUILD, EVALUATE, PROFILE
from .memory import MB
from .models import Layer, Model
from .settings import settings

_BASE = 800 * MB  # a job process with TVM, LLVM and onnxruntime loaded
_PER_THREAD = 16 * MB  # a thread of TVM's pool: its stack, its share of the malloc arenas
_PER_LAYER = MB // 2  # compiling a layer: its Relax and TIR functions, its LLVM code
# Copies alive at the peak of (the inputs' batch, the largest activation, the weights): the
# data as read, cast and widened for its statistics; the activations the compiled program
# keeps; the weights as ONNX, Relax constants, compiled code and (for their statistics) float64.
_COPIES = {PROFILE: (10, 4, 5), EVALUATE: (16, 6, 8), BUILD: (0, 0, 6)}
# A histogram's counts: a copy per TVM thread and spread (stats_kernel._SPREAD), the program's
# output vector, its running total, its record, their merges.
_HISTOGRAM_COPIES = (4, 5)
# A rate no host reaches: a profile reads every value of every tensor more than once (measured
# on 2 Zen 4 cores: 40 ns a value for resnet18, 3 ns for digits_cnn in batches of 4096).
_SECONDS_PER_VALUE = 1e-10
_WHAT = {PROFILE: "the run", EVALUATE: "the evaluation", BUILD: "the build"}


@dataclass(frozen=True)
class ModelShapes:
    """What an estimate needs of a model, from its layers, at the model's own batch."""

    batch: int
    inputs: int  # bytes
    largest: int  # bytes of the largest activation
    weights: int  # bytes
    values: int  # of the inputs and activations
    tensors: int  # that a profile observes
    layers: int

    @classmethod
    def of(cls, db: Database, model: Model) -> ModelShapes:
        with db.read() as session:
            rows = session.execute(
                select(Layer.kind, Layer.shape, Layer.dtype).where(Layer.model_id == model.id)
            ).all()
        return cls.from_layers(
            [{"kind": k, "shape": s, "dtype": d} for k, s, d in rows], model.inputs
        )

    @classmethod
    def from_layers(cls, layers: list[dict], inputs: list[dict]) -> ModelShapes:
        """Of a model's ``layers`` and ``inputs`` as its upload recorded them (``ModelOut``)."""
        sizes = {"input": [], "activation": [], "weight": []}
        values = tensors = 0
        for layer in layers:
            counted = _values(layer["shape"], layer["dtype"])
            if counted is None or layer["kind"] not in sizes:
                continue  # a tuple, a shape: no tensor of its own
            count, itemsize = counted
            sizes[layer["kind"]].append(count * itemsize)
            values += count if layer["kind"] != "weight" else 0
            tensors += 1
        first = inputs[0]["shape"] if inputs else []
        return cls(
            batch=max(1, first[0]) if first else 1,
            inputs=sum(sizes["input"]),
            largest=max(sizes["activation"], default=0),
            weights=sum(sizes["weight"]),
            values=values,
            tensors=tensors,
            layers=len(layers),
        )


def _values(shape: list | None, dtype: str) -> tuple[int, int] | None:
    """The values and bytes per value of a layer's tensor; None for what is no tensor."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    try:
        return math.prod(shape), np.dtype(dtype).itemsize
    except TypeError:
        return None


@dataclass(frozen=True)
class Estimate:
    task: str  # PROFILE, EVALUATE or BUILD
    peak: int  # bytes of address space
    per_sample_s: float  # at least

    def refuse_over_memory(self) -> None:
        """422 when the peak is over this server's memory for a job."""
        limit = settings().job_memory_mb
        if self.peak > limit * MB:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"{_WHAT[self.task]} would need about {self.peak / MB:.0f} MB of memory "
                f"(estimated from the model's shapes), over this server's limit of {limit} MB "
                "per job",
            )

    def refuse_over_time(self, samples: int, limit_s: float) -> None:
        """422 when ``samples`` could not be done within ``limit_s`` even at best."""
        least = samples * self.per_sample_s
        if least > limit_s:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"{_WHAT[self.task]} would take at least {least:.0f} s ({samples} samples at "
                f"{self.per_sample_s:.2g} s each at best, estimated from the model's shapes), "
                f"over this server's time limit of {limit_s:g} s per job",
            )


def estimate(
    shapes: ModelShapes, task: str, *, batch: int | None = None, bins: int = 0, data: bool = True
) -> Estimate:
    """The estimate of ``task`` on the model of ``shapes`` at ``batch`` samples a run (default:
    the model's), with ``bins`` histogram bins (a profile); a build evaluates its ``data`` (an
    accuracy budget) as an evaluation does."""
    threads = int(os.environ.get("TVM_NUM_THREADS") or os.cpu_count() or 1)
    copies = _COPIES[EVALUATE if task == BUILD and data else task]
    scale = (batch or shapes.batch) / shapes.batch
    peak = _BASE + threads * _PER_THREAD + shapes.layers * _PER_LAYER
    peak += scale * (copies[0] * shapes.inputs + copies[1] * shapes.largest)
    peak += copies[2] * shapes.weights
    if task == PROFILE and bins:
        per_thread, more = _HISTOGRAM_COPIES
        peak += shapes.tensors * bins * 8 * (per_thread * threads + more)
    passes = {PROFILE: 1, EVALUATE: 2, BUILD: 2 if data else 0}[task]  # FP32 and INT8
    per_sample = passes * shapes.values / shapes.batch * _SECONDS_PER_VALUE
    return Estimate(task, math.ceil(peak), per_sample)


def accept(
    db: Database,
    model: Model,
    task: str,
    *,
    batch: int | None = None,
    bins: int = 0,
    data: bool = True,
) -> Estimate:
    """The estimate of a job (:func:`estimate`) on ``model``; 422 when its peak is over this
    server's memory for a job. Its time is checked once its samples are counted
    (:meth:`Estimate.refuse_over_time`)."""
    found = estimate(ModelShapes.of(db, model), task, batch=batch, bins=bins, data=data)
    found.refuse_over_memory()
    return found
