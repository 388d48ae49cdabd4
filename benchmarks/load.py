"""The service under load: 100 concurrent clients for 60 s against `rangeprof serve`, on SQLite
and on PostgreSQL, with one server process and with `--workers N`.

    python benchmarks/load.py [--clients 100] [--seconds 60] [--backends sqlite postgresql]
        [--workers 2] [--rounds 1] [--json load.json]

Each backend gets a fresh database, a token, and a `rangeprof serve --jobs 1` server holding
the trained digits CNN and one done profiling run (64 random samples). With `--workers N`
(N > 1) the same database is loaded by a server of one process and by one of N processes
(`serve --workers N`), in turn, `--rounds` times (interleaved: the machine's other load falls on
both alike); each figure is the median of its rounds, and the N-process server's requests/s and
p99 are also given as ratios to the one-process server's. Then ``--clients``
clients, each with its own connection, send requests back to back for ``--seconds``: a mix of
what a dashboard and scripts do (the model list, a model with its layers, a run, its profile
document, a tensor's statistics, a layer's lineage, the run list) and one write in 22
(``POST /api/runs/{id}/qparams``: calibration from the stored statistics, a row written).
Printed per backend: requests/s, p50 / p99 latency, and errors (any transport error or a status
other than the request's success). Clients and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlencode

import httpx
import psycopg

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODEL = SHARED / "models" / "digits_cnn.onnx"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


def _host() -> str:
    flags = Path("/proc/cpuinfo").read_text()
    name = next(
        line.split(":", 1)[1].strip() for line in flags.splitlines() if "model name" in line
    )
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX2"
    return f"{name} ({isa}), {len(os.sched_getaffinity(0))} vCPUs, {platform.node()}"


@contextmanager
def _database(backend: str, folder: Path):
    if backend == "sqlite":
        yield f"sqlite:///{folder / 'load.db'}"
        return
    name = f"rangeprof_load_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def _rangeprof(*args: str) -> str:
    command = [sys.executable, "-m", "rangeprof", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _server(url: str, folder: Path, workers: int):
    port = _free_port()
    log = (folder / "serve.log").open("w")
    args = ["serve", "--db", url, "--port", str(port), "--storage", str(folder / "blobs")]
    args += ["--workers", str(workers)]
    process = subprocess.Popen([sys.executable, "-m", "rangeprof", *args], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start: {(folder / 'serve.log').read_text()}")
            try:
                if httpx.get(f"{base}/api/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def _prepare(base: str, token: str) -> list[tuple[str, str, dict | None, int]]:
    """Upload the model, profile it, and return the request mix: (method, path, json, status)."""
    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=300)
    with MODEL.open("rb") as f:
        model = api.post("/api/models", files={"file": (MODEL.name, f)}).raise_for_status().json()
    run = api.post(f"/api/models/{model['id']}/runs", data={"random": "64"}).raise_for_status()
    run_id = run.json()["id"]
    deadline = time.monotonic() + 300
    while (status := api.get(f"/api/runs/{run_id}").json()["status"]) != "done":
        if status in ("failed", "cancelled") or time.monotonic() > deadline:
            raise SystemExit(f"the profiling run ended {status}")
        time.sleep(0.5)
    query = urlencode({"profile_id": model["layers"][len(model["layers"]) // 2]["profile_id"]})
    api.close()
    reads = [
        ("GET", "/api/models", None, 200),
        ("GET", f"/api/models/{model['id']}", None, 200),
        ("GET", f"/api/models/{model['id']}/runs", None, 200),
        ("GET", f"/api/runs/{run_id}", None, 200),
        ("GET", f"/api/runs/{run_id}/profile", None, 200),
        ("GET", f"/api/runs/{run_id}/tensor?{query}", None, 200),
        ("GET", f"/api/models/{model['id']}/lineage?{query}", None, 200),
    ]
    write = ("POST", f"/api/runs/{run_id}/qparams", {"method": "percentile"}, 201)
    return [*reads * 3, write]


async def _client(base, token, mix, offset, stop_at, latencies, errors) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as api:
        i = offset
        while time.monotonic() < stop_at:
            method, path, body, expected = mix[i % len(mix)]
            i += 1
            start = time.perf_counter()
            try:
                response = await api.request(method, path, json=body)
                outcome = response.status_code
            except httpx.TransportError as err:
                outcome = type(err).__name__
            latencies.append(time.perf_counter() - start)
            if outcome != expected:
                errors.append(f"{method} {path.split('?')[0]}: {outcome}")


async def _load(base: str, token: str, mix, clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors: list[str] = []
    start = time.monotonic()
    stop_at = start + seconds
    await asyncio.gather(
        *(_client(base, token, mix, k, stop_at, latencies, errors) for k in range(clients))
    )
    elapsed = time.monotonic() - start
    cuts = statistics.quantiles(latencies, n=100)
    return {
        "requests": len(latencies),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(cuts[49] * 1000, 1),
        "p99_ms": round(cuts[98] * 1000, 1),
        "errors": len(errors),
        "error_kinds": {kind: errors.count(kind) for kind in sorted(set(errors))},
    }


def _backend(backend: str, args: argparse.Namespace) -> dict[int, dict]:
    """The figures of each server process count on a fresh database of ``backend``: the median
    of each figure over the rounds."""
    counts = sorted({1, args.workers})
    rounds: dict[int, list[dict]] = {workers: [] for workers in counts}
    with tempfile.TemporaryDirectory() as tmp, _database(backend, Path(tmp)) as url:
        _rangeprof("db", "upgrade", "--db", url)
        token = _rangeprof("token", "create", "load", "--db", url).strip()
        mix = None
        for _ in range(args.rounds):
            for workers in counts:
                with _server(url, Path(tmp), workers) as base:
                    mix = mix or _prepare(base, token)
                    load = _load(base, token, mix, args.clients, args.seconds)
                    rounds[workers].append(asyncio.run(load))
    return {workers: _median(figures) for workers, figures in rounds.items()}


def _median(rounds: list[dict]) -> dict:
    numbers = ("requests", "requests_per_s", "p50_ms", "p99_ms", "errors")
    figures = {key: statistics.median(r[key] for r in rounds) for key in numbers}
    kinds = sorted({kind for r in rounds for kind in r["error_kinds"]})
    return figures | {
        "error_kinds": {k: sum(r["error_kinds"].get(k, 0) for r in rounds) for k in kinds}
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--workers", type=int, default=1, help="server processes to compare")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {"host": _host(), "clients": args.clients, "seconds": args.seconds}
    for backend in args.backends:
        results[backend] = by_workers = _backend(backend, args)
        for workers, figures in by_workers.items():
            print(
                f"{backend:>10} x{workers}: {figures['requests_per_s']:7.1f} req/s  "
                f"p50 {figures['p50_ms']:6.1f} ms  p99 {figures['p99_ms']:7.1f} ms  "
                f"errors {figures['errors']:g} of {figures['requests']:g}",
                flush=True,
            )
            for kind, count in figures["error_kinds"].items():
                print(f"{'':>15}{count} x {kind}")
        if args.workers > 1:
            one, many = by_workers[1], by_workers[args.workers]
            print(
                f"{'':>10} x{args.workers} / x1: "
                f"{many['requests_per_s'] / one['requests_per_s']:.2f} x req/s, "
                f"{many['p99_ms'] / one['p99_ms']:.2f} x p99"
            )
    print(f"host: {results['host']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
