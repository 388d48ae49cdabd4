"""The FastAPI application: ``create_app(db_url, ...)`` wires the database, the blob store, the
size limits and (unless ``jobs=0``) the in-process worker, and turns every user error into a 4xx
response with a one-line JSON ``detail``. OpenAPI is served at ``/openapi.json``, docs at
``/docs``, the web dashboard at ``/dashboard/``.
"""

from __future__ import annotations

import functools
from contextlib import asynccontextmanager
from importlib import metadata
from pathlib import Path

from fastapi import FastAPI, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from rangeprof.profiler.errors import RangeprofError

from . import (
    routes_builds,
    routes_evaluations,
    routes_layers,
    routes_models,
    routes_runs,
    routes_tokens,
)
from .context import Service
from .dashboard import routes as dashboard
from .jobs import Worker
from .limits import DEFAULT_LIMITS, BodyLimit, Limits
from .migrate import open_database
from .schemas import ErrorOut, HealthOut
from .security import SecurityHeaders
from .storage import BlobStore, storage_root

_ERRORS = {
    401: {"model": ErrorOut, "description": "No valid bearer token."},
    404: {"model": ErrorOut, "description": "No such object among the token's own."},
    422: {"model": ErrorOut, "description": "A parameter is missing or malformed."},
    503: {
        "model": ErrorOut,
        "description": "The database is unavailable, or the server is receiving as many uploads "
        "as it takes at once; see Retry-After.",
    },
}


def create_app(
    db_url: str | None = None,
    *,
    storage: str | Path | None = None,
    jobs: int = 1,
    worker_name: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> FastAPI:
    """The service on database ``db_url`` (default: ``RANGEPROF_DB``, else SQLite in the user's
    data folder), which must be migrated to head; ``jobs`` runs at a time in this process."""
    db = open_database(db_url)
    store = BlobStore(storage_root(db.url, storage))
    worker = None
    if jobs:
        worker = Worker(db, store, name=worker_name, jobs=jobs, time_limit_s=limits.max_job_seconds)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if worker is not None:
            worker.start()
        yield
        if worker is not None:
            await run_in_threadpool(worker.stop)
        db.dispose()

    app = FastAPI(
        title="rangeprof",
        version=metadata.version("rangeprof"),
        summary="Tensor-range profiling by profileID: models, runs, profiles, qparams, drift.",
        lifespan=lifespan,
    )
    app.state.service = Service(db, store, worker, limits)
    app.add_middleware(BodyLimit, limits=limits)
    app.add_middleware(SecurityHeaders)

    _handle_errors(app)

    @app.get("/api/health", tags=["service"])
    def health() -> HealthOut:
        """Liveness, without a token (for container health checks)."""
        return HealthOut()

    app.include_router(routes_models.router, responses=_ERRORS)
    app.include_router(routes_runs.router, responses=_ERRORS)
    app.include_router(routes_layers.router, responses=_ERRORS)
    app.include_router(routes_evaluations.router, responses=_ERRORS)
    app.include_router(routes_builds.router, responses=_ERRORS)
    app.include_router(routes_tokens.router, responses=_ERRORS)
    dashboard.mount(app)
    app.openapi = functools.partial(_openapi, app)
    return app


def _handle_errors(app: FastAPI) -> None:
    """Every error as a response with a one-line JSON ``detail``: a user's error a 400, an
    invalid request a 422, the database gone a 503 with Retry-After, a 405 with its Allow."""

    @app.exception_handler(RangeprofError)
    async def _user_error(_request: Request, err: RangeprofError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status.HTTP_400_BAD_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        headers = dict(err.headers or {})
        if err.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            # Starlette names only the methods of the route it tried; the path has others.
            matching = [r for r in app.router.routes if r.matches(request.scope)[0] != Match.NONE]
            methods = {m for r in matching for m in getattr(r, "methods", None) or ()}
            headers["Allow"] = ", ".join(sorted(methods))
        return JSONResponse({"detail": err.detail}, err.status_code, headers=headers)

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    async def _database_gone(_request: Request, err: DBAPIError) -> JSONResponse:
        # A connection the pool could not replace (the database down, restarting, full): the
        # request can succeed later; pre-ping already replaced stale connections.
        return JSONResponse(
            {"detail": "the database is unavailable; retry shortly"},
            status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        for error in err.errors():
            where = " ".join(str(part) for part in error["loc"])
            problems.append(f"{where}: {error['msg']}")
        return JSONResponse({"detail": "; ".join(problems)}, status.HTTP_422_UNPROCESSABLE_CONTENT)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, with every error response as what it is: ``ErrorOut`` as JSON (the
    routes' own media types, text or zip, are their successes'; a 422 is one line too)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, summary=app.summary, routes=app.routes
        )
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}
        for operations in schema["paths"].values():
            for operation in operations.values():
                for code, response in operation.get("responses", {}).items():
                    if code[0] in "45":
                        response["content"] = error
        app.openapi_schema = schema
    return app.openapi_schema
