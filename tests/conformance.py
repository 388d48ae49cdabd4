"""The ONNX backend test suite run through rangeprof, case by case.

Each case (a model and its reference inputs and outputs) goes through what ``rangeprof profile``
runs, which includes all that ``rangeprof inspect`` runs
(:func:`rangeprof.profiler.profiling.run.profile_model` loads, imports and tracks every stage with
:func:`rangeprof.profiler.ir.tracking.track`, then compiles and runs), on an ``.npz`` of the case's
inputs, every input marked constant: one run of the case's exact shapes. It is classified:

``PASS``
    both succeed and every float output of the model is profiled with the reference's min / max;
``CLEAN_UNSUPPORTED``
    a :class:`~rangeprof.profiler.errors.RangeprofError`: the one-line error the CLI prints with
    exit 2;
``WRONG``
    a float output missing from the profile, or a range that disagrees with the reference;
``CRASH``
    any other exception, a dead worker (a signal) or a case over its time limit.

Cases run in worker processes, so a crash of native code loses one case, not the run.
Suites: ``node`` (regenerated with the installed onnx's generator), and ``pytorch-converted``,
``pytorch-operator``, ``simple`` (shipped as data with onnx).

Node cases named ``*_expanded`` run an operator's ONNX function body instead of the operator;
:func:`generate_cases` leaves them out unless asked (``expanded=True``): the tests run without
them (their primitive operators have cases of their own), ``python tests/conformance.py
[--jobs N] [--only SUBSTRING] [--json FILE]`` runs everything and prints the counts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

PASS, CLEAN, WRONG, CRASH = "PASS", "CLEAN_UNSUPPORTED", "WRONG", "CRASH"
SHIPPED_SUITES = ("pytorch-converted", "pytorch-operator", "simple")
CASE_TIMEOUT_S = 300
# CRASH and WRONG cases with their reasons (upstream bugs, semantics TVM does not share)
EXPECTED = Path(__file__).with_name("conformance_expected.json")


@dataclass(frozen=True)
class Case:
    suite: str
    name: str
    folder: str  # model.onnx and test_data_set_0/
    rtol: float
    atol: float

    @property
    def key(self) -> str:
        return f"{self.suite}/{self.name}"


@dataclass(frozen=True)
class Outcome:
    key: str
    status: str
    detail: str
    seconds: float
    error: str = ""  # the class of the RangeprofError a CLEAN_UNSUPPORTED case raised


def _shipped_root() -> Path:
    return Path(onnx.__file__).parent / "backend" / "test" / "data"


def generate_cases(root: Path, expanded: bool = True) -> list[Case]:
    """Writes the node cases (model + first data set) under ``root`` once, and lists the cases
    of the four suites (the ``*_expanded`` node cases only with ``expanded``)."""
    node_dir = root / "node"
    marker = root / f"node-{onnx.__version__}.json"
    if not marker.exists():
        from onnx.backend.test.case import node

        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            collected = node.collect_testcases(None)
        tolerances = {}
        for case in collected:
            folder = node_dir / case.name
            data_dir = folder / "test_data_set_0"
            data_dir.mkdir(parents=True, exist_ok=True)
            (folder / "model.onnx").write_bytes(case.model.SerializeToString())
            inputs, outputs = case.data_sets[0]
            _write_values(data_dir, "input", case.model.graph.input, inputs)
            _write_values(data_dir, "output", case.model.graph.output, outputs)
            tolerances[case.name] = (case.rtol, case.atol)
        marker.write_text(json.dumps(tolerances))
    cases = [
        Case("node", name, str(node_dir / name), rtol, atol)
        for name, (rtol, atol) in sorted(json.loads(marker.read_text()).items())
        if expanded or not name.endswith("_expanded")
    ]
    for suite in SHIPPED_SUITES:
        for folder in sorted((_shipped_root() / suite).iterdir()):
            if (folder / "model.onnx").exists():
                cases.append(Case(suite, folder.name, str(folder), 1e-3, 1e-7))
    return cases


def _write_values(folder: Path, kind: str, infos, values) -> None:
    for j, (info, value) in enumerate(zip(infos, values, strict=False)):
        proto = _to_proto(info, value)
        if proto is not None:
            (folder / f"{kind}_{j}.pb").write_bytes(proto.SerializeToString())


def _to_proto(info: onnx.ValueInfoProto, value):
    kind = info.type.WhichOneof("value")
    if kind == "tensor_type":
        if isinstance(value, onnx.TensorProto):
            return value
        return numpy_helper.from_array(np.asarray(value), info.name)
    if kind == "sequence_type":
        return numpy_helper.from_list(value, info.name)
    if kind == "optional_type":
        return numpy_helper.from_optional(value, info.name)
    return None  # maps: not a tensor the reference can be compared with


def _read_values(folder: Path, kind: str, infos) -> dict[str, object]:
    """A case's inputs or outputs by graph name: arrays for tensors, None for other values."""
    values = {}
    for j, info in enumerate(infos):
        path = folder / f"{kind}_{j}.pb"
        if info.type.WhichOneof("value") != "tensor_type" or not path.exists():
            values[info.name] = None
            continue
        tensor = onnx.TensorProto()
        tensor.ParseFromString(path.read_bytes())
        try:
            values[info.name] = numpy_helper.to_array(tensor)
        except Exception:  # a dtype numpy cannot hold (e.g. some float8 / int4 encodings)
            values[info.name] = None
    return values


def run_case(case: Case, work: Path) -> Outcome:
    """Classifies one case (see the module docstring); ``work`` is a scratch folder."""
    start = time.perf_counter()

    def outcome(status: str, detail: str, error: str = "") -> Outcome:
        return Outcome(case.key, status, detail, round(time.perf_counter() - start, 3), error)

    from rangeprof.profiler.errors import RangeprofError
    from rangeprof.profiler.ir.onnx_load import load_model
    from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

    folder = Path(case.folder)
    model_path = folder / "model.onnx"
    try:
        model = onnx.load(str(model_path), load_external_data=False)
        data_dir = folder / "test_data_set_0"
        inputs = _read_values(data_dir, "input", model.graph.input)
        expected = _read_values(data_dir, "output", model.graph.output)
        # profile_model loads, imports and tracks the stages as `rangeprof inspect` does
        # (rangeprof.profiler.ir.tracking.track), then compiles and runs: one call covers both
        # commands.
        fed = {k: v for k, v in inputs.items() if v is not None}
        # the shapes of the reference inputs, as `--input-shape` gives them (symbolic dims)
        shapes = {k: v.shape for k, v in fed.items() if all(d > 0 for d in v.shape)}
        named = load_model(model_path, shapes).model.graph  # nodes named as profiled
        data = work / "inputs.npz"
        np.savez(data, **{f"a{i}": v for i, v in enumerate(fed.values())})
        spec = f"{data}:{','.join(f'a{i}' for i in range(len(fed)))}" if fed else "random"
        doc = profile_model(
            model_path,
            spec,
            input_shapes=shapes,
            options=ProfileOptions(bins=64, constant_inputs=tuple(fed)),
        )
        problems = _compare(doc, _profiled(doc, named), expected, case)
    except RangeprofError as err:
        return outcome(CLEAN, str(err), type(err).__name__)  # the line the CLI prints
    except Exception as err:
        last = traceback.extract_tb(err.__traceback__)[-1]
        where = f"{Path(last.filename).name}:{last.lineno}"
        text = (str(err).strip().splitlines() or [""])[0][:300]
        return outcome(CRASH, f"{type(err).__name__} at {where}: {text}")
    return outcome(WRONG, "; ".join(problems)) if problems else outcome(PASS, "")


def run_stock(case: Case, work: Path) -> Outcome:
    """The case through the same import and TVM's stock build (``tvm.compile``, no rangeprof
    passes) instead of the profiling build: whether a failure is TVM's own."""
    start = time.perf_counter()
    import tvm
    from tvm import relax

    from rangeprof.profiler.errors import RangeprofError
    from rangeprof.profiler.ir.importer import import_onnx
    from rangeprof.profiler.ir.onnx_load import load_model

    folder = Path(case.folder)
    try:
        loaded = load_model(folder / "model.onnx")
        graph = loaded.model.graph
        inputs = _read_values(folder / "test_data_set_0", "input", graph.input)
        expected = _read_values(folder / "test_data_set_0", "output", graph.output)
        if loaded.value_inputs:  # bound as profiling binds them
            bound = {name: inputs[name] for name in loaded.value_inputs}
            loaded = load_model(folder / "model.onnx", bound=bound)
        vm = relax.VirtualMachine(tvm.compile(import_onnx(loaded).mod, "llvm"), tvm.cpu())
        args = [tvm.runtime.tensor(inputs[name]) for name in loaded.program_inputs]
        result = vm["main"](*args)
        results = [result] if hasattr(result, "numpy") else list(result)
        problems = []
        for (name, want), got in zip(expected.items(), results, strict=False):
            if want is not None and hasattr(got, "numpy"):
                got = got.numpy()
                if not np.allclose(got, want, case.rtol, case.atol, equal_nan=True):
                    problems.append(f"output {name!r} differs from the reference")
    except RangeprofError as err:
        status, detail = CLEAN, str(err)
    except Exception as err:
        status, detail = CRASH, f"{type(err).__name__}: {(str(err).splitlines() or [''])[-1]}"
    else:
        status, detail = (WRONG, "; ".join(problems)) if problems else (PASS, "")
    return Outcome(case.key, status, detail, round(time.perf_counter() - start, 3))


def _profiled(doc: dict, graph: onnx.GraphProto) -> dict[str, dict]:
    """The profile's entry for each ONNX tensor of the graph it names: by ``source_tensor``, or,
    for the output of a node whose fate is ``aliases:<profileID>`` (an Identity), that entry."""
    by_tensor, by_id = {}, {t["profile_id"]: t for t in doc["tensors"]}
    for tensor in doc["tensors"]:
        if tensor["source_tensor"] is not None:
            by_tensor.setdefault(tensor["source_tensor"], tensor)
    fates = doc["lineage"]["fates"]
    for node in graph.node:
        alias = fates.get(node.name, "").removeprefix("aliases:")
        for name in node.output:
            if name not in by_tensor and alias in by_id:
                by_tensor[name] = by_id[alias]
    return by_tensor


def _compare(
    doc: dict, by_tensor: dict[str, dict], expected: dict[str, object], case: Case
) -> list[str]:
    """Every float output is profiled with the reference's finite min and max."""
    problems = []
    for name, value in expected.items():
        if value is None or value.dtype.kind != "f" or value.size == 0:
            continue
        record = by_tensor.get(name)
        if record is None:
            problems.append(f"output {name!r} not profiled")
            continue
        finite = value[np.isfinite(value)].astype(np.float64)
        stats = record
        if finite.size == 0:
            if stats.get("min") is not None:
                problems.append(f"output {name!r}: no finite reference value, profile has some")
            continue
        for what, want in (("min", finite.min()), ("max", finite.max())):
            got = stats.get(what)
            # float16 carries 3 decimal digits: a few of its steps, at least
            rtol = max(case.rtol, 4 * float(np.finfo(value.dtype).eps))
            tol = case.atol + rtol * max(abs(want), np.abs(finite).max() * 1e-3)
            if got is None or not math.isfinite(got) or abs(got - want) > tol:
                problems.append(f"output {name!r}: {what} {got} != {want:.9g}")
    return problems


# Worker processes: one case at a time each; a dead worker costs its case only.


def _worker(conn: Connection, work: str, runner) -> None:
    # One core per worker, and no build cache: every case compiles once.
    os.environ["TVM_NUM_THREADS"] = "1"
    os.environ["RANGEPROF_CACHE"] = "off"
    # What TVM's and onnxsim's native code print would bury the report.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        while True:
            case = conn.recv()
            scratch = Path(work) / str(os.getpid())
            scratch.mkdir(parents=True, exist_ok=True)
            conn.send(runner(case, scratch))


@dataclass
class _Slot:
    process: multiprocessing.Process
    conn: Connection
    case: Case | None = None
    since: float = 0.0


def run_cases(cases: list[Case], work: Path, jobs: int = 2, runner=run_case) -> Iterator[Outcome]:
    """Outcomes of ``runner`` on ``cases`` (in completion order) from ``jobs`` processes."""
    import rangeprof.profiler.profiling.run  # noqa: F401  (imported once here, forked warm into every worker)

    context = multiprocessing.get_context("fork")
    pending = list(reversed(cases))

    def start() -> _Slot:
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(child, str(work), runner), daemon=True)
        process.start()
        child.close()
        return _Slot(process, parent)

    slots = [start() for _ in range(max(1, jobs))]
    try:
        while True:
            for slot in slots:
                if slot.case is None and pending:
                    slot.case, slot.since = pending.pop(), time.perf_counter()
                    slot.conn.send(slot.case)
            busy = [s for s in slots if s.case is not None]
            if not busy:
                return
            ready = wait([s.conn for s in busy], timeout=5)
            for i, slot in enumerate(slots):
                if slot.case is None:
                    continue
                elapsed = time.perf_counter() - slot.since
                if slot.conn in ready:
                    try:
                        result = slot.conn.recv()
                    except (EOFError, OSError):
                        slot.process.join(5)
                        code = slot.process.exitcode
                        result = Outcome(slot.case.key, CRASH, _death(code), round(elapsed, 3))
                        slots[i] = start()
                    else:
                        slot.case = None
                    yield result
                elif elapsed > CASE_TIMEOUT_S:
                    slot.process.kill()
                    slot.process.join()
                    yield Outcome(slot.case.key, CRASH, f"timeout after {elapsed:.0f}s", elapsed)
                    slots[i] = start()
    finally:
        for slot in slots:
            slot.process.kill()


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        import signal

        return f"worker killed by {signal.Signals(-code).name}"
    return f"worker exited with code {code}"


def summarize(outcomes: list[Outcome]) -> dict[str, int]:
    counts = Counter(o.status for o in outcomes)
    return {status: counts.get(status, 0) for status in (PASS, CLEAN, WRONG, CRASH)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", help="run the cases whose key contains this")
    parser.add_argument("--cases", type=Path, default=Path("/tmp/rangeprof-conformance"))
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--rerun", type=Path, help="run the cases that did not pass in this JSON")
    parser.add_argument(
        "--stock", action="store_true", help="TVM's stock build instead of rangeprof's (run_stock)"
    )
    args = parser.parse_args(argv)
    cases = generate_cases(args.cases)
    if args.only:
        cases = [c for c in cases if args.only in c.key]
    if args.rerun:
        failed = {o["key"] for o in json.loads(args.rerun.read_text()) if o["status"] != PASS}
        cases = [c for c in cases if c.key in failed]
    outcomes = []
    runner = run_stock if args.stock else run_case
    for outcome in run_cases(cases, args.cases / "work", args.jobs, runner):
        outcomes.append(outcome)
        line = (outcome.detail.splitlines() or [""])[0]
        print(f"{outcome.status:<17} {outcome.key} {outcome.seconds:.1f}s {line}")
        sys.stdout.flush()
    counts = summarize(outcomes)
    print(json.dumps(counts))
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    if args.stock:
        return 0
    expected = json.loads(EXPECTED.read_text())
    unexpected = [
        o for o in outcomes
        if o.status in (CRASH, WRONG) and expected.get(o.key, {}).get("status") != o.status
    ]  # fmt: skip
    for o in unexpected:
        print(f"not in {EXPECTED.name}: {o.status} {o.key}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
