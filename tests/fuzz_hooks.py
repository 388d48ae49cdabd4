"""Schemathesis hooks of the stateful fuzz run (``SCHEMATHESIS_HOOKS=fuzz_hooks``), which make
its sequences start from, and go on through, real objects:

* half of the bodies of an upload that creates a model, run or evaluation are one the service
  accepts (:data:`fuzz_uploads.BODIES`), the other half the fuzzer's own;
* an id the fuzzer draws (a sequence's first step; never one a link fills in) is, half of the
  time, one of the objects the test created before (``RANGEPROF_FUZZ_SEEDS``: path parameter ->
  ids), among them done runs, which no sequence can make with the worker stopped;
* those seeded models are never deleted (the delete goes to a model that does not exist), so
  that every sequence finds them.

Only for a run of schema-valid requests (``--mode positive``): a negative body replaced by a
valid one would be accepted, as it should."""

from __future__ import annotations

import json
import os

import schemathesis
from hypothesis import strategies as st

from fuzz_uploads import BODIES

SEEDS: dict[str, list[int]] = json.loads(os.environ.get("RANGEPROF_FUZZ_SEEDS", "{}"))
REPORT = "POST /api/runs/{run_id}/evaluations/report"
DELETE_MODEL = "DELETE /api/models/{model_id}"
NO_MODEL = 2**31 - 1


@schemathesis.hook
def flatmap_body(context, body):
    label = context.operation.label
    if label in BODIES:
        return st.sampled_from([body, dict(BODIES[label])])
    if label == REPORT and isinstance(body, dict):  # its layers are never the run's
        return st.sampled_from([body, {**body, "layers": []}])
    return st.just(body)


@schemathesis.hook
def flatmap_path_parameters(context, path_parameters):
    if not path_parameters:  # an operation without any
        return st.just(path_parameters)
    return st.fixed_dictionaries(
        {
            name: st.sampled_from([value, *SEEDS.get(name, [])])
            for name, value in path_parameters.items()
        }
    )


@schemathesis.hook
def map_case(context, case):
    model_id = case.path_parameters.get("model_id")
    if case.operation.label == DELETE_MODEL and model_id in SEEDS.get("model_id", []):
        case.path_parameters = {"model_id": NO_MODEL}
    return case
