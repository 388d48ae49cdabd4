"""Schemathesis against a real uvicorn server with a token: every operation of the OpenAPI
document, schema-valid and invalid requests, and stateful sequences that follow the document's
links; no server error, no response outside the schema, no schema-valid request refused. Every
operation but one: ``DELETE /api/token`` would revoke the fuzzer's own token, and every later
request would be 401.

The sequences start from real objects (:func:`_seed`: a model, a done run, its queued evaluation
and build, a qparams set) and create more: the hooks of :mod:`fuzz_hooks` give
half of the uploads a real ONNX model or .npz, which a schema cannot describe. They follow the
document's links (create, read, list, cancel, delete; figures printed): half of them in the
brief run beside the stateless phases (marker ``fuzz``), seven in ten in the long one (marker
``fuzz_stateful``).

The four uploads (a model, run data, evaluation data, a build's accuracy-budget data) take files
whose content the schema cannot describe: any bytes are schema-valid there, and refusing garbage
is right, so for them the check that schema-valid requests are accepted is left out; every other
check runs on them too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from rangeprof.service.limits import Limits

from fuzz_uploads import DATA, EVALUATION_FORM, MODEL, RUN_FORM
from service_fixtures import BACKENDS, Live, Rangeprof, live_service, wait_for_run

pytestmark = pytest.mark.fuzz

TESTS = Path(__file__).parent
REVOKE = "revoke_token_api_token_delete"
UPLOADS = (
    "upload_model_api_models_post",
    "create_run_api_models__model_id__runs_post",
    "create_evaluation_api_runs__run_id__evaluations_post",
    "create_build_api_runs__run_id__builds_post",
)


@dataclass
class Figures:
    """What a stateful run did, from its NDJSON report."""

    requests: int
    statuses: Counter  # "2xx", "4xx", ... -> responses
    operations: int  # that it called
    linked: int  # operations of the document's links (from or to)
    links: int  # of the document's own, followed at least once
    declared: int  # links of the document
    inferred: int  # links schemathesis found itself, followed

    def __str__(self) -> str:
        classes = ", ".join(f"{n} {c}" for c, n in sorted(self.statuses.items()))
        return (
            f"{self.requests} requests ({classes}), {self.operations} of {self.linked} linked "
            "operations, "
            f"{self.links} of {self.declared} links followed (and {self.inferred} inferred)"
        )


def _command() -> str:
    command = shutil.which("schemathesis")
    if command is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    return command


def _schemathesis(
    command: str, live, folder, *options: str, config: Path | None = None, env=None
) -> str:
    """Run schemathesis on the live server, in ``folder`` (it keeps a cache where it runs); its
    report, after asserting it found nothing."""
    result = subprocess.run(
        [
            command, *(["--config-file", str(config)] if config else []),
            "run", f"{live.owner.base_url}/openapi.json",
            "--header", f"Authorization: {live.owner.headers['authorization']}",
            "--checks", "all", "--max-examples", "10", "--seed", "1", "--workers", "1",
            # An upload is analysed in seconds; on a busy machine, more.
            "--request-timeout", "60", "--exclude-operation-id", REVOKE,
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=folder,
        env=env,
    )  # fmt: skip
    summary = result.stdout[result.stdout.find("SUMMARY") :]
    assert result.returncode == 0, summary or result.stderr
    return result.stdout


def _created(response, code: int) -> dict:
    assert response.status_code == code, response.text
    return response.json()


def _seed(live: Live, folder: Path) -> dict[str, list[int]]:
    """A model with a done run (profiled by a worker started for it alone: the fuzzed jobs
    stay queued, so the fuzz run is bounded by requests), a queued build and evaluation of
    the run and a qparams set; their ids by path parameter."""
    api = live.owner
    model = _created(api.post("/api/models", files={"file": ("fuzz.onnx", MODEL)}), 201)
    run = api.post(
        f"/api/models/{model['id']}/runs", files={"data": ("fuzz.npz", DATA)}, data=RUN_FORM
    )
    run_id = _created(run, 202)["id"]
    log = folder / "worker.log"
    worker = Rangeprof(log, "worker", "--db", live.url, "--storage", str(live.storage))
    try:
        assert wait_for_run(api, run_id, timeout=600)["status"] == "done", log.read_text()
    finally:
        worker.stop()
    build = _created(api.post(f"/api/runs/{run_id}/builds", json={}), 202)
    evaluation = api.post(
        f"/api/runs/{run_id}/evaluations", files={"data": ("fuzz.npz", DATA)}, data=EVALUATION_FORM
    )
    _created(api.post(f"/api/runs/{run_id}/qparams", json={}), 201)
    return {
        "model_id": [model["id"]],
        "run_id": [run_id],
        "build_id": [build["id"]],
        "evaluation_id": [_created(evaluation, 202)["id"]],
    }


@contextmanager
def _seeded(backend: str, folder: Path) -> Iterator[tuple[Live, dict[str, list[int]]]]:
    # No worker: fuzzed runs stay queued, however many (no per-token limit).
    with live_service(backend, folder, Limits(max_queued_per_token=10**6), jobs=0) as live:
        yield live, _seed(live, folder)


def _figures(report: Path, document: dict) -> Figures:
    statuses, operations, links, inferred = Counter(), set(), set(), set()
    for line in report.read_text().splitlines():
        scenario = json.loads(line).get("ScenarioFinished")
        if scenario is None:
            continue
        recorded = scenario["recorder"]
        for case in recorded["cases"].values():
            operations.add((case["value"]["method"], case["value"]["path"]))
            transition = case.get("transition")
            if transition and case["is_transition_applied"]:
                (inferred if transition["is_inferred"] else links).add(transition["id"])
        for interaction in recorded["interactions"].values():
            statuses[f"{interaction['response']['status_code'] // 100}xx"] += 1
    declared, linked = 0, set()
    for path in document["paths"].values():
        for operation in path.values():
            for response in operation["responses"].values():
                targets = {link["operationId"] for link in response.get("links", {}).values()}
                declared += len(targets)
                linked |= targets | ({operation["operationId"]} if targets else set())
    requests = sum(statuses.values())
    return Figures(
        requests, statuses, len(operations), len(linked), len(links), declared, len(inferred)
    )


def _stateful(command: str, live, folder: Path, seeds: dict, examples: int, steps: int):
    """The stateful phase, its sequences ``steps`` long, from the seeded objects (hooks of
    :mod:`fuzz_hooks`); schema-valid requests only, which the hooks' uploads need. Two
    workers: half of the time is the server's, checking uploads in processes of their own."""
    config = folder / "stateful.toml"
    config.write_text(
        # Links to calls that were refused (a run not done yet) are followed as often as others.
        f"[phases.stateful]\nmax-steps = {steps}\nlink-calibration = false\n"
    )
    env = os.environ | {
        "SCHEMATHESIS_HOOKS": "fuzz_hooks",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        "RANGEPROF_FUZZ_SEEDS": json.dumps(seeds),
    }
    report = folder / "stateful.ndjson"
    _schemathesis(
        command, live, folder,
        "--phases", "stateful", "--mode", "positive", "--workers", "2",
        "--max-examples", str(examples), "--exclude-checks", "positive_data_acceptance",
        "--report", "ndjson", "--report-ndjson-path", str(report),
        config=config, env=env,
    )  # fmt: skip
    figures = _figures(report, live.owner.get("/openapi.json").json())
    print(f"stateful, {examples} x {steps} steps: {figures}")
    assert figures.statuses["5xx"] == 0, figures
    return figures


@pytest.mark.parametrize("backend", BACKENDS)
def test_schemathesis_finds_nothing(backend, tmp_path):
    command = _command()
    with _seeded(backend, tmp_path) as (live, seeds):
        figures = _stateful(command, live, tmp_path, seeds, examples=8, steps=80)
        assert figures.links >= 0.4 * figures.declared, figures
        stateless = ("--phases", "examples,coverage,fuzzing")
        others = [f"--exclude-operation-id={op}" for op in UPLOADS]
        uploads = [f"--include-operation-id={op}" for op in UPLOADS]
        report = _schemathesis(command, live, tmp_path, *stateless, *others)
        assert "Tested: 26" in report, report
        report = _schemathesis(
            command, live, tmp_path, *stateless, *uploads,
            "--exclude-checks", "positive_data_acceptance",
        )  # fmt: skip
        assert "Tested: 4" in report, report


@pytest.mark.fuzz_stateful
@pytest.mark.parametrize("backend", BACKENDS)
def test_stateful_sequences_follow_most_links(backend, tmp_path):
    with _seeded(backend, tmp_path) as (live, seeds):
        figures = _stateful(_command(), live, tmp_path, seeds, examples=60, steps=100)
        # Every operation with a link, and two of three links (the rest mostly start from an
        # empty list: a queued run has no evaluation to list).
        assert figures.operations == figures.linked, figures
        assert figures.links >= 2 / 3 * figures.declared, figures
