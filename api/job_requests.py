"""The workflow request of a job, as the service makes it for a run, an evaluation or a build:
its paths are the names of the files in the job's folder, where the worker
(:class:`rangeprof.service.jobs.Worker`) links the model and the uploaded data under these
names and writes the profile or the qparams set.

The request's own validators judge combinations of options, so the API refuses what the CLI
refuses: a message naming CLI flags (``--accuracy-budget needs --data``) names the API's fields.
"""

from __future__ import annotations

import re
from typing import TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from rangeprof.profiler.errors import RangeprofError
from rangeprof.workflows.options import MEASURED, STORED

from .catalog import MODEL_SUFFIX
from .models import Model, Run
from .schemas import NpzRef
from .uploads import UploadError, split_spec

PROFILE_FILE = "profile.json"  # the run's profile document
QPARAMS_FILE = "qparams.json"  # a stored qparams set's document
ARTIFACT_FOLDER = "artifact"  # where a build writes model.so and manifest.json
# The run's calibration data, for bias correction: a folder of its own, as the evaluation data
# beside it may have the same upload name.
CALIBRATION_FOLDER = "calibration"

Request = TypeVar("Request", bound=BaseModel)
_FLAG = re.compile(r"--([a-z][a-z0-9-]*)")


def invalid_body(err: ValidationError) -> RequestValidationError:
    """A refusal of the request body's values: 422, as FastAPI's own validation says it."""
    return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()])


def model_file(model: Model) -> str:
    """The model's name in the job's folder: its upload name, as a CLI run on it would see."""
    return f"{model.name}{MODEL_SUFFIX}"


def job_request(kind: type[Request], **fields) -> Request:
    """``kind(**fields)``, refused as the API refuses: a value the request does not take is
    422, a combination its validators refuse is 400."""
    try:
        return kind(**fields)
    except ValidationError as err:
        raise invalid_body(err) from None
    except RangeprofError as err:
        fields_named = _FLAG.sub(lambda m: repr(m[1].replace("-", "_")), str(err))
        raise UploadError(fields_named) from None


def calibration_data(run: Run, asked: str | None) -> str | None:
    """The calibration data of bias correction ``asked`` on ``run``'s ranges: for
    ``measured``, the run's own .npz in the job's folder (a run of random data has none to
    offer); ``stored`` reads the run's profile, which has per-channel means when the run
    recorded channel statistics."""
    if asked == STORED and not run.request.channel_stats:
        raise UploadError("'bias_correction' 'stored' needs a run profiled with 'channel_stats'")
    if asked != MEASURED:
        return None
    if run.data_sha256 is None:
        raise UploadError(
            "'bias_correction' 'measured' needs the run's calibration data: this run profiled "
            "random samples"
        )
    return f"{CALIBRATION_FOLDER}/{run.request.data}"


def npz_ref(spec: str | None, sha256: str | None) -> NpzRef | None:
    """The uploaded .npz that a request's data option (``FILE.npz:KEY``) names."""
    if spec is None:
        return None
    name, key = split_spec(spec)
    return NpzRef(name=name, key=key, sha256=sha256)
