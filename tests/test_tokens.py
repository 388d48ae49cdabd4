"""Token lifecycle, through the CLI and real HTTP on SQLite and PostgreSQL: tokens expire, are
listed and revoked, and a token that ended is 401 naming why."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update
from typer.testing import CliRunner

from rangeprof.cli import app as cli
from rangeprof.service.db import Database
from rangeprof.service.limits import Limits
from rangeprof.service.models import Token, utcnow

from service_fixtures import BACKENDS, client, live_service, rangeprof

runner = CliRunner()


@pytest.fixture(scope="module", params=BACKENDS)
def live(request, tmp_path_factory):
    with live_service(request.param, tmp_path_factory.mktemp(request.param), Limits(), 0) as live:
        yield live


def _api(live, token: str):
    return client(str(live.owner.base_url), token)


def test_revoked_and_expired_tokens_are_refused_naming_why(live):
    short = rangeprof("token", "create", "short", "--db", live.url, "--expires-days", "1").strip()
    doomed = rangeprof("token", "create", "doomed", "--db", live.url).strip()
    with _api(live, short) as api:
        shown = api.get("/api/token").json()
        assert shown["name"] == "short" and shown["expires_at"] is not None
        assert api.get("/api/models").status_code == 200
        db = Database(live.url)
        with db.session() as session:  # a day later
            session.execute(
                update(Token)
                .where(Token.name == "short")
                .values(expires_at=utcnow() - timedelta(seconds=1))
            )
        db.dispose()
        refused = api.get("/api/models")
        assert refused.status_code == 401 and refused.json()["detail"] == "bearer token expired"
    listed = rangeprof("token", "list", "--db", live.url)
    assert "short" in listed and "expired" in listed and "never" in listed
    rangeprof("token", "revoke", "doomed", "--db", live.url)
    with _api(live, doomed) as api:
        refused = api.get("/api/models")
        assert refused.status_code == 401 and refused.json()["detail"] == "bearer token revoked"
    assert "revoked" in rangeprof("token", "list", "--db", live.url)


def test_a_token_revokes_itself(live):
    token = rangeprof("token", "create", "self", "--db", live.url).strip()
    with _api(live, token) as api:
        assert api.get("/api/token").json()["expires_at"] is None
        assert api.delete("/api/token").status_code == 204
        assert api.get("/api/token").status_code == 401
    assert live.owner.get("/api/models").status_code == 200  # other tokens are untouched


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["revoke", "nobody"], "no token named 'nobody'"),
        (["create", "zero", "--expires-days", "0"], "must be valid for some time"),
    ],
)
def test_token_command_errors_are_one_line(live, args, words):
    result = runner.invoke(cli, ["token", *args, "--db", live.url])
    assert result.exit_code == 2 and words in result.output
    assert len(result.output.strip().splitlines()) == 1
