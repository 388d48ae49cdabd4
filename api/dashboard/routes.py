"""The dashboard's pages and static files.

Pages are static shells: Jinja2 templates extending ``pages/base.html``, which holds the head,
the navigation bar and the error banner they share. Their scripts fetch everything through the
REST API with the token the login page stored, so a page itself needs no token and the API's
access rules apply unchanged (a token sees only its own models). Page URLs name what they show
(a model, a layer by profileID, a run, two runs, an evaluation) and are shareable.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

HERE = Path(__file__).resolve().parent
PREFIX = "/dashboard"
router = APIRouter(prefix=PREFIX, include_in_schema=False)
templates = Jinja2Templates(directory=HERE / "pages")


def _page(request: Request, name: str) -> HTMLResponse:
    """Page ``name``: its template, running ``static/<name>.js``."""
    # no-cache: pages are tiny, and a new version of the package must show at once.
    headers = {"Cache-Control": "no-cache"}
    return templates.TemplateResponse(request, f"{name}.html", {"script": name}, headers=headers)


@router.get("")
def root() -> RedirectResponse:
    """To the dashboard's first page (from its prefix, and from the service's root)."""
    return RedirectResponse(f"{PREFIX}/")


@router.get("/")
def models(request: Request) -> HTMLResponse:
    return _page(request, "models")


@router.get("/login")
def login(request: Request) -> HTMLResponse:
    return _page(request, "login")


@router.get("/models/{model_id}")
def model(request: Request, model_id: int) -> HTMLResponse:
    return _page(request, "model")


@router.get("/models/{model_id}/layer")
def layer(request: Request, model_id: int) -> HTMLResponse:
    """One layer; the profileID and the run are query parameters (``?pid=…&run=…``)."""
    return _page(request, "layer")


@router.get("/runs/{run_id}")
def run(request: Request, run_id: int) -> HTMLResponse:
    return _page(request, "run")


@router.get("/compare")
def compare(request: Request) -> HTMLResponse:
    """Drift from run ``?a=`` to run ``?b=``."""
    return _page(request, "compare")


@router.get("/evaluations/{evaluation_id}")
def evaluation(request: Request, evaluation_id: int) -> HTMLResponse:
    return _page(request, "evaluation")


def mount(app: FastAPI) -> None:
    """The dashboard under :data:`PREFIX`, and the service's root leading to it."""
    app.add_api_route("/", root, include_in_schema=False)
    app.include_router(router)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
