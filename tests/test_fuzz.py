"""Schemathesis against a real uvicorn server with a token (marker ``fuzz``, bounded to seconds):
every operation of the OpenAPI document, schema-valid and invalid requests, stateful sequences;
no server error, no response outside the schema, no schema-valid request refused.

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

UPLOADS = (
    "upload_model_api_models_post",
    "create_run_api_models__model_id__runs_post",
    "create_evaluation_api_runs__run_id__evaluations_post",
    "create_build_api_runs__run_id__builds_post",
)


def _schemathesis(command: str, live, folder, *options: str) -> str:
    """Run schemathesis on the live server, in ``folder`` (it keeps a cache where it runs); its
    summary, after asserting it found nothing."""
    result = subprocess.run(
        [
            command, "run", f"{live.owner.base_url}/openapi.json",
            "--header", f"Authorization: {live.owner.headers['authorization']}",
            "--checks", "all", "--max-examples", "10", "--seed", "1", "--workers", "1",
            # The token revoking itself would leave every later request 401.
            "--exclude-path", "/api/token",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=folder,
    )  # fmt: skip
    summary = result.stdout[result.stdout.find("SUMMARY") :]
    assert result.returncode == 0, summary or result.stderr
    return summary


@pytest.mark.parametrize("backend", BACKENDS)
def test_schemathesis_finds_nothing(backend, tmp_path):
    command = shutil.which("schemathesis")
    if command is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    # No worker: fuzzed runs stay queued, so the run is bounded by requests alone.
    with live_service(backend, tmp_path, Limits(max_queued_per_token=10**6), jobs=0) as live:
        assert upload_model(live.owner, zoo_model("digits_cnn")).status_code == 201
        others = [f"--exclude-operation-id={op}" for op in UPLOADS]
        uploads = [f"--include-operation-id={op}" for op in UPLOADS]
        summary = _schemathesis(command, live, tmp_path, *others)
        assert "Tested: 25" in summary, summary
        summary = _schemathesis(
            command, live, tmp_path, *uploads, "--exclude-checks", "positive_data_acceptance"
        )
        assert "Tested: 4" in summary, summary
