"""Schemathesis against a real uvicorn server with a token (marker ``fuzz``, bounded to seconds):
every operation of the OpenAPI document, schema-valid and invalid requests, and stateful
sequences that follow the document's links (a model listed or read, a run created, read,
cancelled, its model deleted); no server error, no response outside the schema, no schema-valid
request refused. Every operation but one: ``DELETE /api/token`` would revoke the fuzzer's own
token, and every later request would be 401.

The four uploads (a model, run data, evaluation data, a build's accuracy-budget data) take files
whose content the schema cannot describe (an ONNX model, an .npz of the model's inputs): any
bytes are schema-valid there, and refusing garbage is right, so for them the check that
schema-valid requests are accepted is left out; every other check runs on them too."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from rangeprof.service.limits import Limits

from conftest import zoo_model
from service_fixtures import BACKENDS, live_service, upload_model

pytestmark = pytest.mark.fuzz

REVOKE = "revoke_token_api_token_delete"
UPLOADS = (
    "upload_model_api_models_post",
    "create_run_api_models__model_id__runs_post",
    "create_evaluation_api_runs__run_id__evaluations_post",
    "create_build_api_runs__run_id__builds_post",
)


def _schemathesis(command: str, live, folder, *options: str) -> str:
    """Run schemathesis on the live server, in ``folder`` (it keeps a cache where it runs); its
    report, after asserting it found nothing."""
    result = subprocess.run(
        [
            command, "run", f"{live.owner.base_url}/openapi.json",
            "--header", f"Authorization: {live.owner.headers['authorization']}",
            "--checks", "all", "--max-examples", "10", "--seed", "1", "--workers", "1",
            # An upload is analysed in seconds; on a busy machine, more.
            "--request-timeout", "60", "--exclude-operation-id", REVOKE,
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=folder,
    )  # fmt: skip
    summary = result.stdout[result.stdout.find("SUMMARY") :]
    assert result.returncode == 0, summary or result.stderr
    return result.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_schemathesis_finds_nothing(backend, tmp_path):
    command = shutil.which("schemathesis")
    if command is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    # No worker: fuzzed runs stay queued, so the run is bounded by requests alone. Models for
    # the stateful sequences to start from (a fuzzed upload is no ONNX model), and to delete.
    with live_service(backend, tmp_path, Limits(max_queued_per_token=10**6), jobs=0) as live:
        for _ in range(4):
            assert upload_model(live.owner, zoo_model("digits_cnn")).status_code == 201
        report = _schemathesis(  # without model uploads: slow, and never an ONNX model
            command, live, tmp_path,
            "--phases", "stateful", "--max-examples", "20",
            f"--exclude-operation-id={UPLOADS[0]}",
            "--exclude-checks", "positive_data_acceptance",
        )  # fmt: skip
        covered = int(report.split("API Links:")[1].split("covered")[0])
        assert covered > 0, report  # sequences followed links
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
