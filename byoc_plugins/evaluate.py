"""How much accuracy INT8 costs, per model and per layer (keyed by profileID).

Three programs built from one :class:`~rangeprof.byoc.quantized.QuantizedModel`, each exposing
every region's output (:func:`~rangeprof.byoc.lowering.lower` with ``expose``):

* **fp32**: every region FP32 — the reference, layer by layer;
* **int8**: the regions as deployed (``modes``: INT8, or FP32 where kept) — *accumulated* error:
  each layer's output after every quantized layer before it;
* **shadow**: FP32 downstream, each region's INT8 core computed beside it on the FP32 input —
  *isolated* error: what quantizing that layer alone costs.

Per layer: SQNR ``10·log10(Σ ref² / Σ (ref − q)²)`` in dB over all samples, and the RMS error in
units of the layer's output scale (1/√12 ≈ 0.29 is pure rounding). Per model: SQNR of the first
output, top-1 agreement between FP32 and INT8, top-1 accuracy of both with labels, and a
caller's ``metric(outputs, labels)`` of both (the Python API's: points, higher is better).

:func:`fit_budget` widens the most sensitive layers (lowest isolated SQNR first) until the
metric's drop (else top-1's, else, without labels, the disagreement) is within a budget in
points: to int16
activations first where the policy has them, then, if every layer on int16 is not enough, to
FP32 in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.compile.threads import vm_function
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.data import model_inputs, open_arrays, open_data

from .lowering import FP32, INT8, INT16, SHADOW, default_mode
from .quantized import QuantizedModel

Progress = Callable[[str, int, int], None]
# A caller's figure of merit: the first output of every sample and the labels -> points.
Metric = Callable[[np.ndarray, np.ndarray | None], float]
# A data spec, or arrays held in memory (model_data).
Data = str | Mapping[str, np.ndarray] | np.ndarray | list


@dataclass
class _Error:
    """Σ ref² and Σ (ref − q)² over every sample: SQNR and RMS error add up exactly."""

    signal: float = 0.0
    noise: float = 0.0
    count: int = 0

    def add(self, ref: np.ndarray, q: np.ndarray) -> None:
        ref = ref.astype(np.float64)
        self.signal += float(np.square(ref).sum())
        self.noise += float(np.square(ref - q.astype(np.float64)).sum())
        self.count += ref.size

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0:
            return math.inf
        if self.signal == 0:
            return -math.inf
        return 10 * math.log10(self.signal / self.noise)

    @property
    def rmse(self) -> float:
        return math.sqrt(self.noise / self.count) if self.count else 0.0


def _db(value: float) -> float | None:
    """JSON has no infinities: an exact match (no noise) is reported as ``None``."""
    return None if math.isinf(value) else round(value, 3)


@dataclass
class LayerError:
    profile_id: str
    region: str
    pattern: str
    mode: str
    scale: float | None
    weight_bits: int | None  # None: FP32, or no constant weights
    isolated: _Error = field(default_factory=_Error)
    accumulated: _Error = field(default_factory=_Error)

    def to_json(self) -> dict:
        scale = self.scale or 1.0
        return {
            "profile_id": self.profile_id,
            "region": self.region,
            "pattern": self.pattern,
            "mode": self.mode,
            "weight_bits": self.weight_bits,
            "isolated_sqnr_db": _db(self.isolated.sqnr_db),
            "accumulated_sqnr_db": _db(self.accumulated.sqnr_db),
            "isolated_rmse_per_scale": round(self.isolated.rmse / scale, 4),
            "accumulated_rmse_per_scale": round(self.accumulated.rmse / scale, 4),
        }


@dataclass
class Evaluation:
    samples: int
    output: _Error
    agree: int
    fp32_correct: int | None
    int8_correct: int | None
    layers: list[LayerError]
    weight_bits: int | None  # the policy's: None, chosen per layer
    kept_fp32: list[str] = field(default_factory=list)  # profileIDs of regions kept in FP32
    kept_int16: list[str] = field(default_factory=list)  # ... run on int16 activations
    kept_int8: list[str] = field(default_factory=list)  # 4-bit layers raised to 8 bits
    fp32_metric: float | None = None  # the caller's metric, when given
    int8_metric: float | None = None
    relative: bool = False  # the metric's drop in % of FP32's (a loss such as bpc)

    @property
    def agreement(self) -> float:
        return 100.0 * self.agree / self.samples

    @property
    def fp32_top1(self) -> float | None:
        return None if self.fp32_correct is None else 100.0 * self.fp32_correct / self.samples

    @property
    def int8_top1(self) -> float | None:
        return None if self.int8_correct is None else 100.0 * self.int8_correct / self.samples

    @property
    def drop(self) -> float:
        """The metric's points lost (with one), else top-1's (with labels), else the
        disagreement in points."""
        if self.int8_metric is not None:
            drop = self.fp32_metric - self.int8_metric
            return 100.0 * drop / abs(self.fp32_metric) if self.relative else drop
        if self.fp32_correct is None:
            return 100.0 - self.agreement
        return self.fp32_top1 - self.int8_top1

    @property
    def plan(self) -> list[str]:
        """The widened layers as ``layer_modes`` entries (``PROFILEID=MODE``)."""
        kept = ((FP32, self.kept_fp32), (INT16, self.kept_int16), (INT8, self.kept_int8))
        return [f"{pid}={mode}" for mode, ids in kept for pid in ids]

    def ranked(self) -> list[LayerError]:
        """Worst isolated SQNR first (the sensitivity ranking)."""
        return sorted(self.layers, key=lambda e: (e.isolated.sqnr_db, e.accumulated.sqnr_db))

    def to_json(self) -> dict:
        doc = {
            "samples": self.samples,
            "weight_bits": self.weight_bits,
            "agreement": round(self.agreement, 3),
            "output_sqnr_db": _db(self.output.sqnr_db),
            "layers": [e.to_json() for e in self.ranked()],
            "kept_fp32": self.kept_fp32,
            "kept_int16": self.kept_int16,
            **({"kept_int8": self.kept_int8} if self.kept_int8 else {}),
            "plan": self.plan,
        }
        if self.fp32_correct is not None:
            doc["fp32_top1"] = round(self.fp32_top1, 3)
            doc["int8_top1"] = round(self.int8_top1, 3)
        if self.int8_metric is not None:
            doc["fp32_metric"], doc["int8_metric"] = self.fp32_metric, self.int8_metric
        return doc


def _first(value) -> tvm.runtime.Tensor:
    while not isinstance(value, tvm.runtime.Tensor):
        value = value[0]
    return value


class Program:
    """A lowered and compiled program exposing every region's output (in ``ids`` order)."""

    def __init__(self, qm: QuantizedModel, modes: dict[str, str]):
        mod, self.ids = qm.lower(modes, expose=True)
        self.vm = relax.VirtualMachine(qm.plugin.compile(mod), tvm.cpu())

    def run(self, inputs: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        result = vm_function(self.vm)(*(tvm.runtime.tensor(a) for a in inputs))
        return _first(result[0]).numpy(), [result[i + 1].numpy() for i in range(len(self.ids))]


def _bias(region) -> bytes | None:
    """The region's float bias, as part of a compiled program's key (bias correction moves it)."""
    bias = region.float_region.bias
    return None if bias is None else bias.tobytes()


def model_data(qm: QuantizedModel, data: Data, samples: int | None):
    """``data`` opened for ``qm``'s inputs, in batches of the model's own batch: a
    :func:`~rangeprof.profiler.profiling.data.open_data` spec, or arrays the caller holds
    (:func:`~rangeprof.profiler.profiling.data.open_arrays`: a dict of arrays, one array, or a
    list of batches of any sizes, gathered whole since evaluations count samples and read them
    more than once)."""
    loaded = qm.imported.loaded
    batch = next(iter(loaded.input_shapes.values()))[0]
    inputs = model_inputs(loaded.facts)
    if isinstance(data, str):
        return open_data(data, inputs, batch_size=batch, samples=samples)
    source = open_arrays(data, inputs, batch_size=batch, samples=samples)
    if source.num_samples is not None:
        return source
    batches = list(source.batches())
    if not batches:
        raise RangeprofError("the data holds no samples")
    gathered = {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}
    return open_arrays(gathered, inputs, batch_size=batch)


def program(
    qm: QuantizedModel,
    name: str,
    modes: dict[str, str],
    compiled: dict,
    announce: Callable[[], None] | None = None,
) -> Program:
    """The program of ``qm`` with region ``modes``, from ``compiled`` when it holds one for the
    same modes (the ``fp32`` one, with every region FP32, also for any qparams and biases);
    ``announce`` is called before a compile."""
    key = (name, tuple(sorted(modes.items())))
    if name != "fp32":
        key += (tuple((r.name, r.input, r.output, r.weight_bits, _bias(r)) for r in qm.regions),)
    if key not in compiled:
        if announce:
            announce()
        compiled[key] = Program(qm, modes)
    return compiled[key]


def evaluate(
    qm: QuantizedModel,
    data: Data,
    labels: np.ndarray | None = None,
    samples: int | None = None,
    kept_fp32: frozenset[str] = frozenset(),
    progress: Progress | None = None,
    compiled: dict | None = None,
    kept_int16: frozenset[str] = frozenset(),
    metric: Metric | None = None,
    kept_int8: frozenset[str] = frozenset(),
) -> Evaluation:
    """FP32 vs INT8 on ``data`` (:func:`model_data`'s); regions whose output profileID is in
    ``kept_fp32`` stay FP32, those in ``kept_int16`` run on int16 activations, 4-bit ones in
    ``kept_int8`` on 8 bits. ``compiled``
    caches programs across calls: the FP32 and shadow programs do not depend on ``kept_fp32``,
    and the FP32 one not on the qparams either
    (:meth:`~rangeprof.byoc.quantized.QuantizedModel.replanned` models share it). Top-1 is
    measured with 1-D integer ``labels``; ``metric`` gets every sample's first output of each
    program and the labels (any array with a sample axis, or ``None``)."""
    source = model_data(qm, data, samples)
    if labels is not None and len(labels) < source.num_samples:
        raise RangeprofError(f"{len(labels)} labels for {source.num_samples} samples")
    top1 = labels is not None and labels.ndim == 1 and labels.dtype.kind in "iu"
    quantizable = [r for r in qm.regions if r.fallback is None]
    modes = {r.name: region_mode(r, kept_fp32, kept_int16, kept_int8) for r in quantizable}
    programs = _programs(qm, modes, {} if compiled is None else compiled, progress)
    layers = [
        LayerError(
            r.output_id,
            r.name,
            r.pattern,
            modes[r.name],
            r.output.scale if r.output else None,
            qm.weight_bits(r, modes[r.name]),
        )
        for r in quantizable
    ]
    tally = _Tally(programs, layers, labels if top1 else None, metric is not None)
    for batch_arrays in source.batches():
        tally.add(list(batch_arrays.values()))
        if progress:
            progress("evaluating", tally.seen, source.num_samples)
    scores = {}
    if metric is not None:
        truth = None if labels is None else labels[: tally.seen]
        scores = {
            f"{name}_metric": float(metric(np.concatenate(got), truth))
            for name, got in tally.outputs.items()
        }
    return Evaluation(
        samples=tally.seen,
        output=tally.output,
        agree=tally.agree,
        fp32_correct=tally.fp32_correct if top1 else None,
        int8_correct=tally.int8_correct if top1 else None,
        layers=layers,
        weight_bits=qm.plugin.policy.weight_bits,
        kept_fp32=sorted(kept_fp32),
        kept_int16=sorted(kept_int16 - kept_fp32),
        kept_int8=sorted(kept_int8 - kept_fp32 - kept_int16),
        relative=getattr(metric, "relative", False),
        **scores,
    )


def _programs(
    qm: QuantizedModel, modes: dict[str, str], compiled: dict, progress: Progress | None
) -> dict[str, Program]:
    """The three programs of the module doc, by name, with the INT8 one's region ``modes``."""
    quantizable = [r for r in qm.regions if r.fallback is None]
    stages = [
        ("fp32", {r.name: FP32 for r in qm.regions}),
        ("int8", modes),
        ("shadow", {r.name: SHADOW for r in quantizable}),
    ]
    programs = {}
    for index, (name, stage_modes) in enumerate(stages):
        announce = progress and partial(progress, f"compiling {name}", index, len(stages))
        programs[name] = program(qm, name, stage_modes, compiled, announce)
    return programs


class _Tally:
    """The running comparison of the three programs, batch after batch: the first output's
    error and top-1 agreement, top-1 against ``labels`` (when given), each layer's accumulated
    and isolated error, and, with ``keep_outputs``, every first output (for a metric)."""

    def __init__(
        self,
        programs: dict[str, Program],
        layers: list[LayerError],
        labels: np.ndarray | None,
        keep_outputs: bool,
    ):
        self.programs, self.layers, self.labels = programs, layers, labels
        self.keep_outputs = keep_outputs
        self.position = {
            name: {pid: i for i, pid in enumerate(p.ids)} for name, p in programs.items()
        }
        self.output = _Error()
        self.agree = self.fp32_correct = self.int8_correct = self.seen = 0
        self.outputs: dict[str, list[np.ndarray]] = {"fp32": [], "int8": []}

    def add(self, inputs: list) -> None:
        """Runs the three programs on one batch and adds up what they give."""
        ref, ref_layers = self.programs["fp32"].run(inputs)
        got, got_layers = self.programs["int8"].run(inputs)
        _, shadow_layers = self.programs["shadow"].run(inputs)
        self.output.add(ref, got)
        ref_top, got_top = ref.reshape(len(ref), -1).argmax(1), got.reshape(len(got), -1).argmax(1)
        self.agree += int((ref_top == got_top).sum())
        if self.keep_outputs:
            self.outputs["fp32"].append(ref)
            self.outputs["int8"].append(got)
        if self.labels is not None:
            truth = self.labels[self.seen : self.seen + len(ref)]
            self.fp32_correct += int((ref_top == truth).sum())
            self.int8_correct += int((got_top == truth).sum())
        position = self.position
        for layer in self.layers:
            reference = ref_layers[position["fp32"][layer.profile_id]]
            layer.accumulated.add(reference, got_layers[position["int8"][layer.profile_id]])
            layer.isolated.add(reference, shadow_layers[position["shadow"][layer.profile_id]])
        self.seen += len(ref)


def region_mode(
    region,
    kept_fp32: frozenset[str],
    kept_int16: frozenset[str],
    kept_int8: frozenset[str] = frozenset(),
) -> str:
    """The mode of a region given the profileIDs kept in FP32, on int16 and (4-bit ones) on
    8 bits (the widest wins)."""
    if region.fallback or region.output_id in kept_fp32:
        return FP32
    if region.output_id in kept_int16:
        return INT16
    return INT8 if region.output_id in kept_int8 else default_mode(region)


def fit_budget(
    qm: QuantizedModel,
    data: Data,
    budget: float,
    labels: np.ndarray | None = None,
    samples: int | None = None,
    progress: Progress | None = None,
    compiled: dict | None = None,
    metric: Metric | None = None,
    start: Mapping[str, frozenset[str]] | None = None,
) -> Evaluation:
    """The evaluation with the fewest regions widened (most sensitive first) whose drop
    (:attr:`Evaluation.drop`: of ``metric`` when given) is within ``budget`` points; all of them
    FP32 is the last resort. Each region climbs its ladder one rung at a time and the search
    moves on to the next region once a rung lowers the drop: a 4-bit layer to 8 bits, then
    int16 activations where the policy has them, then FP32 — int16 removes rounding error, not
    the clipping of a badly calibrated range (which FP32 removes). A region no rung helps on its
    own keeps its lowest-drop rung, the narrowest on a tie: its error may only show once its
    neighbours are widened too. ``start``: the profileIDs already widened, by mode (a plan the
    search goes on from)."""
    compiled = {} if compiled is None else compiled
    kept = {m: frozenset((start or {}).get(m, ())) for m in (INT8, INT16, FP32)}
    result = evaluate(
        qm, data, labels, samples, kept[FP32], progress, compiled, kept[INT16], metric,
        kept[INT8],
    )  # fmt: skip

    def trial(mode: str, profile_id: str) -> tuple[dict, Evaluation]:
        tried = {m: ids - {profile_id} for m, ids in kept.items()}
        tried[mode] |= {profile_id}
        return tried, evaluate(
            qm, data, labels, samples, tried[FP32], progress, compiled, tried[INT16], metric,
            tried[INT8],
        )  # fmt: skip

    ladders = {r.output_id: _ladder(qm, r) for r in qm.regions if r.fallback is None}
    for profile_id in [e.profile_id for e in result.ranked()]:
        if result.drop <= budget:
            break
        best = None
        for mode in ladders.get(profile_id, (FP32,)):
            tried, widened = trial(mode, profile_id)
            if best is None or widened.drop < best[1].drop:
                best = tried, widened
            if widened.drop < result.drop:
                break
        kept, result = best
    return result


def _ladder(qm: QuantizedModel, region) -> tuple[str, ...]:
    """The modes a region is widened to, in order."""
    weighted = region.float_region.weight is not None
    wide = qm.plugin.policy.wide_activations is not None and weighted
    return (INT8,) * (region.int4 is not None) + (INT16,) * wide + (FP32,)


@dataclass(frozen=True)
class BitsPerCharacter:
    """A language model's bits per character (token): the mean of ``-log2 softmax(logits)``
    at the labels, over every position; ``logits`` the first output ``[N, ..., V]``, labels
    the next tokens ``[N, ...]``. A loss: its value is ``-bpc`` (higher is better) and its drop
    is in % of FP32's (:attr:`relative`)."""

    relative = True

    def __call__(self, outputs: np.ndarray, labels: np.ndarray | None) -> float:
        if labels is None or labels.dtype.kind not in "iu":
            raise RangeprofError("metric bpc: the labels must be the next tokens (integers)")
        if outputs.shape[: labels.ndim] != labels.shape or outputs.ndim != labels.ndim + 1:
            raise RangeprofError(
                f"metric bpc: labels {list(labels.shape)} do not index the logits "
                f"{list(outputs.shape)} (one per position, the vocabulary last)"
            )
        logits = outputs.astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        log_z = np.log(np.exp(logits).sum(axis=-1))
        picked = np.take_along_axis(logits, labels[..., None].astype(np.int64), -1)[..., 0]
        return -float(np.mean(log_z - picked) / np.log(2.0))
