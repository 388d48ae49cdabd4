"""``rangeprof profile``: run calibration data through the instrumented model and record stats.

Memory stays bounded: one batch of data and one set of the program's outputs are alive at a
time, and per-tensor statistics are fixed-size records merged batch by batch.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.compile.cache import BuildCache, cache_key
from rangeprof.profiler.compile.schedules import host_target
from rangeprof.profiler.errors import InputShapeError
from rangeprof.profiler.ir.fates import ALIASES, Fate
from rangeprof.profiler.ir.importer import ImportedModel
from rangeprof.profiler.ir.onnx_load import LoadedModel, ModelFacts, load_model
from rangeprof.profiler.ir.passes.equalize import NAME as EQUALIZATION
from rangeprof.profiler.ir.spans import ids_of
from rangeprof.profiler.ir.tagging import LayerRecord
from rangeprof.profiler.ir.tracking import track
from rangeprof.profiler.profiling.data import (
    CalibrationData,
    Preprocess,
    StreamedData,
    model_inputs,
    open_arrays,
    open_data,
    sample_batch,
)
from rangeprof.profiler.profiling.document import build_document
from rangeprof.profiler.profiling.executor import (
    Observed,
    ProfilingProgram,
    channel_axis,
    compile_program,
)
from rangeprof.profiler.profiling.statistics import DEFAULT_BINS, TensorStats
from rangeprof.profiler.profiling.stats_kernel import Totals


@dataclass(frozen=True)
class ProfileOptions:
    bins: int = DEFAULT_BINS  # histogram bins; 0 disables histograms
    batch_size: int | None = None  # None: the model's own batch (1 for a symbolic batch)
    samples: int | None = None
    seed: int = 0
    # inputs fed whole in every run, not batched along dim 0 (see rangeprof.profiler.profiling.data)
    constant_inputs: tuple[str, ...] = ()
    equalize: bool = False  # profile the cross-layer equalized model (ir.passes.equalize)
    # Per-channel min, max and exact mean of every activation with a channel axis (axis 1 of
    # NCHW / NCW tensors, the last of 2-D ones): what bias correction from stored statistics
    # reads. Opt-in: each observed tensor's kernel then keeps per-channel sums as well.
    channel_stats: bool = False
    # Data checks (rangeprof.profiler.profiling.data, "Checks"): profile NaN and infinity in the
    # data rather than refuse them; cast data of another kind of dtype to its input's.
    allow_nonfinite: bool = False
    cast: bool = False

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["constant_inputs"] = list(self.constant_inputs)
        return doc


Progress = Callable[[int, int], None]  # (samples done, samples total)


@dataclass
class _Prepared:
    """A compiled program for one batch size, and the model facts its build produced."""

    model: ModelFacts
    program: ProfilingProgram
    layers: list[LayerRecord]
    stages: list[dict]  # stage reports as JSON
    cached: bool
    graph_outputs: dict[str, str]  # graph output name -> profileID of the value it is


def _file_digest(path: Path) -> str | None:
    """sha256 of the file, or None when it cannot be read (loading then says why)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


@dataclass
class _Request:
    key: str | None  # None: the file could not be read (loading says why)
    model: ModelFacts
    hit: tuple[relax.VirtualMachine, dict] | None
    loaded: LoadedModel | None  # on a miss


class _Builder:
    """Prepared programs by batch size, each from the build cache when it has them.

    The cache key is the model file's digest and the request (input shapes, batch size, bins),
    so a hit needs neither ONNX loading nor simplification: the facts loading learned are in
    the sidecar.
    """

    def __init__(
        self,
        path: Path,
        bins: int | None,
        constant: frozenset[str],
        cache: BuildCache,
        equalize: bool = False,
        channel_stats: bool = False,
    ):
        self.path, self.bins, self.constant, self.cache = path, bins, constant, cache
        self.equalize, self.channel_stats = equalize, channel_stats
        self.digest = _file_digest(path)
        self.target = host_target()
        self.bound: dict[str, np.ndarray] = {}  # the value inputs' values, once the data gives them

    def bind(self, values: dict[str, np.ndarray]) -> bool:
        """Loads the model with these values of its value inputs from now on; whether there
        were any (requests made before were for the unspecialised model)."""
        self.bound = dict(values)
        return bool(self.bound)

    def request(self, input_shapes: dict | None, batch_size: int | None) -> _Request:
        """The model facts for a request, from the cache or by loading the model: enough to
        check calibration data before anything is compiled."""
        key = None
        if self.digest is not None:
            shapes = dict(input_shapes or {})
            bound = {k: [v.dtype.str, v.tolist()] for k, v in sorted(self.bound.items())}
            key = cache_key(
                "profile",
                self.digest,
                shapes,
                self.target,
                bins=self.bins,
                batch=batch_size,
                bound=bound,
                equalize=self.equalize,
                # named only when on: default profiles keep the keys of their cached builds
                **({"channel_stats": True} if self.channel_stats else {}),
            )
            hit = self.cache.load(key)
            if hit is not None:
                return _Request(key, ModelFacts.from_json(hit[1]["model"]), hit, None)
        loaded = _load_for_batch(self.path, input_shapes, batch_size, self.constant, self.bound)
        return _Request(key, loaded.facts, None, loaded)

    def prepare(self, request: _Request) -> _Prepared:
        """The compiled program for a request (a cache hit compiles nothing)."""
        if request.hit is not None:
            return self._from_cache(*request.hit)
        return self._build(request.loaded, request.key)

    def _from_cache(self, vm: relax.VirtualMachine, side: dict) -> _Prepared:
        model = ModelFacts.from_json(side["model"])
        observed = [Observed(**o) for o in side["observed"]]
        static = {k: TensorStats.from_json(v) for k, v in side["static"].items()}
        program = ProfilingProgram(
            vm, model.program_inputs, observed, static, self.bins or 0, self.channel_stats
        )
        layers = [LayerRecord(**layer) for layer in side["layers"]]
        return _Prepared(model, program, layers, side["stages"], True, side["graph_outputs"])

    def _build(self, loaded: LoadedModel, key: str | None) -> _Prepared:
        tracked = track(loaded, equalize=self.equalize)
        imported = tracked.imported
        if self.equalize:  # the program observes the equalized model, under the same IDs
            imported = replace(imported, mod=tracked.stage("equalize").mod)
        stages = [s.report.to_json() for s in tracked.stages]
        names = loaded.program_inputs
        load = None if key is None else functools.partial(self.cache.store_library, key)
        _, program = compile_program(
            imported.mod, imported.layers, names, self.bins, self.target, load, self.channel_stats
        )
        program.static.update(_weight_stats(imported, self.bins))
        model = replace(loaded.facts, fates=imported.fates)
        outputs = graph_outputs(loaded, imported)
        if key is not None:
            sidecar = {
                "model": model.to_json(),
                "observed": [asdict(o) for o in program.observed],
                "static": {k: v.to_json() for k, v in program.static.items()},
                "layers": [layer.to_json() for layer in imported.layers],
                "stages": stages,
                "graph_outputs": outputs,
            }
            self.cache.store_sidecar(key, sidecar)
        return _Prepared(model, program, imported.layers, stages, False, outputs)


def graph_outputs(loaded: LoadedModel, imported: ImportedModel) -> dict[str, str]:
    """The profileID whose value each graph output is.

    A binding holds one ONNX tensor's name (``source_tensor``), that of the node that made it.
    A graph output that only renames an existing value — ppocr_cls's ``Identity`` after its
    softmax, Identity-like nodes that the importer turns into no binding — is that value,
    profiled under the binding of the tensor it renames: only its node's fate
    (``aliases:<id>``) leads there. Outputs that are constants (folded) have no entry."""
    graph = loaded.model.graph
    by_tensor = {r.source_tensor: r.profile_id for r in imported.layers if r.source_tensor}
    producer = {name: node.name for node in graph.node for name in node.output}
    found = {}
    for output in graph.output:
        profile_id = by_tensor.get(output.name)
        fate = imported.fates.get(producer.get(output.name, ""))
        fate = None if fate is None else Fate.parse(fate)
        if profile_id is None and fate is not None and fate.kind == ALIASES:
            profile_id = fate.target
        if profile_id is not None:
            found[output.name] = profile_id
    return found


def _builder(path: str | Path, options: ProfileOptions, cache: BuildCache | None) -> _Builder:
    return _Builder(
        Path(path),
        options.bins or None,
        frozenset(options.constant_inputs),
        BuildCache() if cache is None else cache,
        options.equalize,
        options.channel_stats,
    )


class _Programs:
    """Programs by batch size (a smaller last batch needs its own build)."""

    def __init__(self, builder: _Builder, first: _Prepared):
        self.builder = builder
        self.model = first.model
        self.by_batch = {_batch_of(first.model, builder.constant): first.program}

    def get(self, batch: int) -> ProfilingProgram:
        if batch not in self.by_batch:
            shapes = _with_batch(self.model, batch, self.builder.constant)
            try:
                request = self.builder.request(shapes, None)
            except InputShapeError as err:
                raise InputShapeError(
                    f"a last batch of {batch} samples does not fit the model ({err}); "
                    "use a sample count that the batch size divides"
                ) from None
            self.by_batch[batch] = self.builder.prepare(request).program
        return self.by_batch[batch]


def _batch_of(model: ModelFacts, constant: frozenset[str]) -> int:
    return sample_batch(model_inputs(model, constant))


def _with_batch(model: ModelFacts, batch: int, constant: frozenset[str]) -> dict:
    """The input shapes for another batch: per-sample inputs change dim 0, constants stay."""
    return {
        i.name: i.shape if i.constant else (batch, *i.shape[1:])
        for i in model_inputs(model, constant)
    }


def _load_for_batch(
    path: Path,
    input_shapes: dict | None,
    batch_size: int | None,
    constant: frozenset[str],
    bound: dict[str, np.ndarray],
) -> LoadedModel:
    loaded = load_model(path, input_shapes, bound=bound)
    if batch_size is None or _batch_of(loaded, constant) == batch_size:
        return loaded
    shapes = _with_batch(loaded, batch_size, constant)
    try:
        return load_model(path, shapes, bound=bound)
    except InputShapeError as err:
        raise InputShapeError(f"batch size {batch_size} does not fit the model: {err}") from None


def weight_channel_axes(mod: tvm.IRModule) -> dict[str, int]:
    """Output-channel axis of each weight: conv kernels (OIHW) 0, matmul right operands their
    last axis, traced back through a transpose (Gemm's ``permute_dims(W)``)."""
    axes: dict[str, int] = {}
    permuted: dict[relax.Var, tuple[frozenset[str], list[int]]] = {}
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not isinstance(call, tvm.ir.Call) or not isinstance(call.op, tvm.ir.Op):
                continue
            op, args = str(call.op.name), list(call.args)
            if op == "relax.permute_dims" and isinstance(args[0], tvm.ir.GenericConst):
                ndim = len(args[0].value.shape)
                order = [int(a) for a in call.attrs.axes] if call.attrs.axes else None
                permuted[binding.var] = (ids_of(args[0]), order or list(range(ndim))[::-1])
            elif op == "relax.nn.conv2d" and isinstance(args[1], tvm.ir.GenericConst):
                axes.update(dict.fromkeys(ids_of(args[1]), 0))
            elif op == "relax.matmul":
                rhs = args[1]
                if isinstance(rhs, tvm.ir.GenericConst):
                    axes.update(dict.fromkeys(ids_of(rhs), len(rhs.value.shape) - 1))
                elif rhs in permuted:
                    ids, order = permuted[rhs]
                    axes.update(dict.fromkeys(ids, order[-1]))
    return axes


def _weight_stats(imported: ImportedModel, bins: int | None) -> dict[str, TensorStats]:
    axes = weight_channel_axes(imported.mod)
    stats: dict[str, TensorStats] = {}

    def visit(expr):
        if isinstance(expr, tvm.ir.GenericConst):
            for profile_id in ids_of(expr):
                if profile_id not in stats:
                    array = expr.value.numpy()
                    if np.issubdtype(array.dtype, np.floating):
                        stats[profile_id] = TensorStats.observe(array, bins, axes.get(profile_id))

    relax.analysis.post_order_visit(imported.mod["main"], visit)
    return stats


class ModelProfiler:
    """A model compiled for profiling and the run loop over its data, reusable for any number of
    data slices: :func:`profile_model` uses one for a whole data set, a Ray worker
    (:mod:`rangeprof.profiler.profiling.distributed`) keeps one for every shard it profiles."""

    def __init__(self, builder: _Builder, prepared: _Prepared):
        self.prepared = prepared
        self.programs = _Programs(builder, prepared)
        inputs = model_inputs(prepared.model, builder.constant)
        self.batch_size = sample_batch(inputs)
        self.per_sample = [i.name for i in inputs if not i.constant]  # the sample axis is theirs
        self.bins = builder.bins
        self.channel_stats = builder.channel_stats

    @classmethod
    def prepare(
        cls,
        path: str | Path,
        *,
        input_shapes: dict | None = None,
        options: ProfileOptions = ProfileOptions(),
        cache: BuildCache | None = None,
        bound: dict[str, np.ndarray] | None = None,
    ) -> ModelProfiler:
        """Loads and compiles the model for ``options`` (a build-cache hit compiles nothing),
        with ``bound`` values of its value inputs (:meth:`CalibrationData.bound_values`)."""
        builder = _builder(path, options, cache)
        builder.bind(bound or {})
        return cls(builder, builder.prepare(builder.request(input_shapes, options.batch_size)))

    def ready_for(self, batch: int) -> None:
        """Compiles the program for a smaller last batch now, so that a batch size the model
        cannot take fails before the run rather than at its end."""
        self.programs.get(batch)

    def observe(
        self, batches: Iterable[dict[str, np.ndarray]], progress: Callable[[int], None] | None
    ) -> tuple[dict[str, TensorStats], int]:
        """Statistics of every profiled tensor over ``batches`` (run in order), and the sample
        count; ``progress`` gets the samples done after each batch."""
        stats: dict[str, TensorStats] = dict(self.programs.get(self.batch_size).static)
        inputs = {r.source_tensor: r for r in self.prepared.layers if r.kind == "input"}
        totals: dict[str, Totals] = {}  # the observed tensors, merged run after run
        done = 0
        for batch in batches:
            size = batch[self.per_sample[0]].shape[0] if self.per_sample else 1
            self.programs.get(size).run_into(batch, totals)
            for name, array in batch.items():
                # Bound value inputs are weights of the program (profiled as such).
                if name in inputs and np.issubdtype(array.dtype, np.floating):
                    layer, sums = inputs[name], self.channel_stats
                    axis = channel_axis(layer, array.ndim, every=True) if sums else None
                    record = TensorStats.observe(array, self.bins, axis, sums)
                    previous = stats.get(layer.profile_id)
                    stats[layer.profile_id] = record if previous is None else previous.merge(record)
            done += size
            if progress:
                progress(done)
        stats.update((profile_id, total.stats()) for profile_id, total in totals.items())
        return stats, done

    def document(
        self,
        stats: dict[str, TensorStats],
        *,
        samples: int,
        batches: int,
        data: str,
        options: ProfileOptions,
        timings: dict[str, float],
    ) -> dict:
        """The profile document of statistics that :meth:`observe` returned."""
        run = {
            "samples": samples,
            "batches": batches,
            "data": data,
            "options": {**options.to_json(), "batch_size": self.batch_size},
            "build_cache": "hit" if self.prepared.cached else "miss",
            "timings": timings,
            "tvm_version": tvm.__version__,
        }
        model, layers = self.prepared.model, self.prepared.layers
        program = self.programs.get(self.batch_size)
        static_ids = set(program.static)
        masks = {o.profile_id: (o.nonfinite_inputs, o.nonfinite_origins) for o in program.observed}
        transforms = (EQUALIZATION,) if options.equalize else ()
        return build_document(
            model,
            layers,
            model.fates,
            self.prepared.stages,
            stats,
            static_ids,
            run,
            transforms,
            self.prepared.graph_outputs,
            masks,
        )


# A profile's ``run.data`` when the data was arrays rather than a ``--data`` spec.
IN_MEMORY = "arrays"
Data = str | Mapping[str, np.ndarray] | np.ndarray | Iterable


def _open(
    model: ModelFacts, data: Data, options: ProfileOptions, preprocess: Preprocess | None
) -> CalibrationData | StreamedData:
    """The data for the model, checked through before any work (``verify``)."""
    constant = frozenset(options.constant_inputs)
    inputs = model_inputs(model, constant)
    batch_size = _batch_of(model, constant)
    checks = {"allow_nonfinite": options.allow_nonfinite, "cast": options.cast}
    if not isinstance(data, str):
        source = open_arrays(data, inputs, batch_size=batch_size, samples=options.samples, **checks)
    else:
        source = open_data(
            data,
            inputs,
            batch_size=batch_size,
            samples=options.samples,
            seed=options.seed,
            preprocess=preprocess,
            **checks,
        )
        source = replace(source, value_inputs=model.value_inputs)
    source.verify()
    return source


def open_calibration(
    path: str | Path,
    data: str,
    *,
    input_shapes: dict | None = None,
    options: ProfileOptions = ProfileOptions(),
    preprocess: Preprocess | None = None,
    cache: BuildCache | None = None,
) -> CalibrationData:
    """The calibration data a profiling run of the model reads, checked against its inputs and
    read through (the data checks), in its batches, without compiling anything (the model's
    facts come from the build cache, or from loading it)."""
    builder = _builder(path, options, cache)
    return _open(builder.request(input_shapes, options.batch_size).model, data, options, preprocess)


def profile_model(
    path: str | Path,
    data: Data,
    *,
    input_shapes: dict | None = None,
    options: ProfileOptions = ProfileOptions(),
    preprocess: Preprocess | None = None,
    progress: Progress | None = None,
    cache: BuildCache | None = None,
) -> dict:
    """Profiles one ONNX model on calibration data (a ``--data`` spec, or arrays the caller
    holds: :func:`~rangeprof.profiler.profiling.data.open_arrays`); returns the profile
    document."""
    timings: dict[str, float] = {}
    start = time.perf_counter()

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 6)
        return now

    builder = _builder(path, options, cache)
    request = builder.request(input_shapes, options.batch_size)
    source = _open(request.model, data, options, preprocess)  # checked before compiling
    if builder.bind(source.bound_values()):
        request = builder.request(input_shapes, options.batch_size)
    profiler = ModelProfiler(builder, builder.prepare(request))
    if source.num_samples and source.num_samples % source.batch_size:
        profiler.ready_for(source.num_samples % source.batch_size)
    mark = lap("prepare_s", start)  # load, import, track stages, compile (or cache hits)

    def advance(done: int) -> None:
        progress(done, source.num_samples)

    stats, done = profiler.observe(source.batches(), advance if progress else None)
    lap("run_s", mark)
    timings["total_s"] = round(time.perf_counter() - start, 6)
    return profiler.document(
        stats,
        samples=done,
        batches=math.ceil(done / source.batch_size),
        data=data if isinstance(data, str) else IN_MEMORY,
        options=options,
        timings=timings,
    )
