"""Every face offers the same options with the same defaults, because each derives them from
the one declaration in ``rangeprof/workflows/options.py``: the CLI's flags, the Python API's
keyword options, the REST API's bodies (and so the OpenAPI document the dashboard's forms read).
"""

from __future__ import annotations

import inspect

import pytest
import typer.main

import rangeprof
from rangeprof import facade
from rangeprof.cli import app
from rangeprof.profiler.errors import RangeprofError
from rangeprof.service.schemas import (
    BuildOptions,
    BuildUpload,
    CalibrationRequest,
    EvaluationRequest,
    ExportQuery,
    RunRequest,
)
from rangeprof.workflows import requests
from rangeprof.workflows.options import CalibrationOptions, ProfileOptions, QuantizeOptions

from conftest import zoo_model

GROUPS = {
    ProfileOptions: {
        "cli": ["profile"],
        "api": [RunRequest],
        "request": [requests.ProfileRequest],
    },
    CalibrationOptions: {
        "cli": ["calibrate", "export"],
        "api": [CalibrationRequest, ExportQuery],
        "request": [requests.CalibrateRequest, requests.ExportRequest],
    },
    QuantizeOptions: {
        "cli": ["build", "evaluate"],
        "api": [EvaluationRequest, BuildOptions, BuildUpload],
        "request": [requests.BuildRequest, requests.EvaluateRequest],
    },
}


def _cli_defaults(command: str) -> dict:
    click_command = typer.main.get_command(app).commands[command]
    return {p.name: p.default for p in click_command.params}


def _default(group, name):
    value = group.model_fields[name].get_default(call_default_factory=True)
    return None if value == () else value  # an empty repeatable option


@pytest.mark.parametrize("group", list(GROUPS), ids=lambda g: g.__name__)
def test_the_cli_offers_every_option_with_its_default(group):
    for command in GROUPS[group]["cli"]:
        defaults = _cli_defaults(command)
        for name in group.model_fields:
            assert name in defaults, (command, name)
            assert defaults[name] == _default(group, name), (command, name)


@pytest.mark.parametrize("group", list(GROUPS), ids=lambda g: g.__name__)
def test_the_rest_api_and_the_requests_inherit_every_option(group):
    for face in [*GROUPS[group]["api"], *GROUPS[group]["request"]]:
        assert issubclass(face, group), face
        schema = face.model_json_schema()["properties"]
        for name, field in group.model_fields.items():
            assert name in schema, (face, name)
            assert face.model_fields[name].description == field.description, (face, name)
            if face.model_fields[name].is_required():
                continue
            expected = field.get_default(call_default_factory=True)
            assert schema[name].get("default") == (
                list(expected) if isinstance(expected, tuple) else expected
            ), (face, name)


def test_the_python_api_repeats_no_default_and_refuses_unknown_options(tmp_path):
    """The facade takes the groups' options as keywords, validated by the group: none of its
    own parameters shadows an option with another default, and a misspelt one is an error."""
    functions = {
        facade.profile: ProfileOptions,
        facade.Profile.calibrate: CalibrationOptions,
        facade.build: QuantizeOptions,
        facade.evaluate: QuantizeOptions,
    }
    for function, group in functions.items():
        for name, parameter in inspect.signature(function).parameters.items():
            if name in group.model_fields and parameter.default is not inspect.Parameter.empty:
                assert parameter.default == _default(group, name), (function, name)
    profile = rangeprof.profile(zoo_model("digits_cnn"), "random", samples=2)
    with pytest.raises(RangeprofError, match="methd"):
        profile.calibrate(methd="mse")
    with pytest.raises(RangeprofError, match="scheme"):
        profile.calibrate(scheme="symmetric")


def test_the_target_list_is_the_plugins():
    from rangeprof.byoc.plugin import TARGETS

    assert QuantizeOptions.model_json_schema()["properties"]["target"]["enum"] == list(TARGETS)
