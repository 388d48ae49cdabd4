"""The dashboard's pages and static files.

Pages are static shells; their scripts fetch everything through the REST API with the token
the login page stored, so a page itself needs no token and the API's access rules apply
unchanged (a token sees only its own models). Page URLs name what they show (a model, a layer
by profileID, a run, two runs, an evaluation) and are shareable.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

HERE = Path(__file__).resolve().parent
PREFIX = "/dashboard"
router = APIRouter(prefix=PREFIX, include_in_schema=False)


def _page(name: str) -> FileResponse:
    # no-cache: pages are tiny, and a new version of the package must show at once.
    return FileResponse(HERE / "pages" / f"{name}.html", headers={"Cache-Control": "no-cache"})


@router.get("")
def root() -> RedirectResponse:
    return RedirectResponse(f"{PREFIX}/")


@router.get("/")
def models() -> FileResponse:
    return _page("models")


@router.get("/login")
def login() -> FileResponse:
    return _page("login")


@router.get("/models/{model_id}")
def model(model_id: int) -> FileResponse:
    return _page("model")


@router.get("/models/{model_id}/layer")
def layer(model_id: int) -> FileResponse:
    """One layer; the profileID and the run are query parameters (``?pid=…&run=…``)."""
    return _page("layer")


@router.get("/runs/{run_id}")
def run(run_id: int) -> FileResponse:
    return _page("run")


@router.get("/compare")
def compare() -> FileResponse:
    """Drift from run ``?a=`` to run ``?b=``."""
    return _page("compare")


@router.get("/evaluations/{evaluation_id}")
def evaluation(evaluation_id: int) -> FileResponse:
    return _page("evaluation")


def mount(app: FastAPI) -> None:
    app.include_router(router)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
