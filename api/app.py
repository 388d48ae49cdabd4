"""The FastAPI application: ``create_app(db_url, ...)`` wires the database, the blob store, the
size limits and (unless ``jobs=0``) the in-process worker, and turns every user error into a 4xx
response with a one-line JSON ``detail``. OpenAPI is served at ``/openapi.json`` (with links from
the operations that answer a model, run, evaluation or build to those that take its id), docs at
``/docs``, the web dashboard at ``/dashboard/``. ``rangeprof serve --workers N`` runs the app in N
processes on one database and storage (:func:`processes_app`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from fastapi import FastAPI, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount
from starlette.types import Scope

from rangeprof.profiler.errors import RangeprofError

from . import (
    routes_builds,
    routes_evaluations,
    routes_layers,
    routes_models,
    routes_runs,
    routes_tokens,
    sandbox,
)
from .context import Service, admit_jobs
from .dashboard import routes as dashboard
from .db import disk_full, foreign_key_violation
from .jobs import Worker
from .limits import DEFAULT_LIMITS, BodyLimit, Limits
from .migrate import open_database
from .schemas import ErrorOut, HealthOut
from .security import SecurityHeaders
from .storage import BlobStore, out_of_space, storage_root

_ERRORS = {
    401: {"model": ErrorOut, "description": "No valid bearer token."},
    404: {"model": ErrorOut, "description": "No such object among the token's own."},
    409: {
        "model": ErrorOut,
        "description": "What the request refers to is not in a state for it, or was deleted "
        "while the request was being answered.",
    },
    422: {
        "model": ErrorOut,
        "description": "A parameter is missing or malformed, or the work asked for is over one "
        "of the server's limits (an upload's analysis time or memory, a job's estimated memory "
        "or time).",
    },
    503: {
        "model": ErrorOut,
        "description": "The database is unavailable, or the server is receiving as many uploads "
        "as it takes at once; see Retry-After.",
    },
    507: {
        "model": ErrorOut,
        "description": "The server's storage or the database's disk is full: nothing was stored.",
    },
}
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# The environment variable handing create_app's arguments to the processes of `serve --workers`.
_PROCESSES_ENV = "RANGEPROF_SERVE_PROCESS"


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
        sandbox.start()  # here: after uvicorn has set its signal handlers
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
    admit_jobs(db, limits)
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


def processes_app(
    db_url: str | None, *, storage: str | None, jobs: int, worker_name: str, limits: Limits
) -> str:
    """``rangeprof serve --workers N``: hand these arguments of :func:`create_app` to the server
    processes, through the environment; the import string of their app factory for uvicorn."""
    options = {"db_url": db_url, "storage": storage, "jobs": jobs, "worker_name": worker_name}
    os.environ[_PROCESSES_ENV] = json.dumps(options | {"limits": asdict(limits)})
    return f"{__name__}:process_app"


def process_app() -> FastAPI:
    """The app of one process of ``rangeprof serve --workers N``. Its worker's name is the
    server's with the process id: each process holds its own jobs, and those of a process that
    died are swept by the others' heartbeat threads."""
    options = json.loads(os.environ[_PROCESSES_ENV])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s %(message)s")
    return create_app(
        options["db_url"],
        storage=options["storage"],
        jobs=options["jobs"],
        worker_name=f"{options['worker_name']}/{os.getpid()}",
        limits=Limits(**options["limits"]),
    )


def _allowed(app: FastAPI, scope: Scope) -> str:
    """The methods the request's path answers, for a 405's ``Allow`` (Starlette names only the
    methods of the route it tried, FastAPI's included routers none)."""
    methods = set()
    for route in app.router.routes:
        if isinstance(route, Mount):  # the dashboard's static files: a mount takes any method
            methods |= {"GET", "HEAD"} if route.matches(scope)[0] != Match.NONE else set()
            continue
        methods |= {m for m in _METHODS if route.matches({**scope, "method": m})[0] == Match.FULL}
    return ", ".join(sorted(methods))


def _no_room(what: str) -> JSONResponse:
    return JSONResponse(
        {"detail": f"{what} is full: nothing was stored; retry once there is room"},
        status.HTTP_507_INSUFFICIENT_STORAGE,
        headers={"Retry-After": "60"},
    )


def _handle_errors(app: FastAPI) -> None:
    """Every error as a response with a one-line JSON ``detail``: a user's error a 400, an
    invalid request a 422, the database gone a 503 with Retry-After, a full disk a 507, a
    create whose model or run was deleted meanwhile a 409, a 405 with its Allow."""

    @app.exception_handler(RangeprofError)
    async def _user_error(_request: Request, err: RangeprofError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status.HTTP_400_BAD_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        headers = dict(err.headers or {})
        if err.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            headers["Allow"] = _allowed(app, request.scope)
        return JSONResponse({"detail": err.detail}, err.status_code, headers=headers)

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    async def _database_gone(_request: Request, err: DBAPIError) -> JSONResponse:
        if disk_full(err):
            return _no_room("the database's disk")
        # A connection the pool could not replace (the database down, restarting): the
        # request can succeed later; pre-ping already replaced stale connections.
        return JSONResponse(
            {"detail": "the database is unavailable; retry shortly"},
            status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(OSError)
    async def _storage_full(_request: Request, err: OSError) -> JSONResponse:
        if not out_of_space(err):
            raise err  # a server error, as without this handler
        return _no_room("the server's storage")

    @app.exception_handler(IntegrityError)
    async def _conflict(_request: Request, err: IntegrityError) -> JSONResponse:
        # The transaction was rolled back, and the request's files with it.
        if foreign_key_violation(err):
            detail = "what this request refers to was deleted meanwhile: nothing was stored"
        else:
            detail = "the request conflicts with what is stored: nothing was stored"
        return JSONResponse({"detail": detail}, status.HTTP_409_CONFLICT)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        for error in err.errors():
            where = " ".join(str(part) for part in error["loc"])
            problems.append(f"{where}: {error['msg']}")
        return JSONResponse({"detail": "; ".join(problems)}, status.HTTP_422_UNPROCESSABLE_CONTENT)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, with every error response as what it is: ``ErrorOut`` as JSON (the
    routes' own media types, text or zip, are their successes'; a 422 is one line too), and
    :func:`_links`."""
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
        _links(schema)
        app.openapi_schema = schema
    return app.openapi_schema


def _links(schema: dict) -> None:
    """OpenAPI links from each success that answers a model, run, evaluation or build (a created
    one, a read one, the first of a list) to every operation whose path parameters its ids fill
    (``id`` of ``RunOut`` is ``run_id``, its ``model_id`` is ``model_id``): create, read, cancel
    and delete chain, as a client (and a stateful fuzzer) would call them."""
    operations = [op for ops in schema["paths"].values() for op in ops.values()]
    takes = {
        op["operationId"]: [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]
        for op in operations
    }
    for operation in operations:
        for code, response in operation["responses"].items():
            body = response.get("content", {}).get("application/json", {}).get("schema", {})
            ids = _ids(body, schema["components"]["schemas"]) if code[0] == "2" else {}
            links = {
                target: {
                    "operationId": target,
                    "parameters": {name: f"$response.body#{ids[name]}" for name in names},
                }
                for target, names in takes.items()
                if names and all(name in ids for name in names)
            }
            if links:
                response["links"] = links


def _ids(body: dict, components: dict) -> dict[str, str]:
    """The path parameters a response body fills: name -> JSON pointer into the body."""
    prefix = ""
    if body.get("type") == "array":  # a list: its first item
        body, prefix = body.get("items", {}), "/0"
    name = body.get("$ref", "").rpartition("/")[2]
    properties = components.get(name, {}).get("properties", {})
    if "id" not in properties:  # not an object of the API's own (a layer table, a tensor)
        return {}
    kind = name.removesuffix("Out").removesuffix("Summary").lower()
    ids = {f: f"{prefix}/{f}" for f in properties if f.endswith("_id")}
    return ids | {f"{kind}_id": f"{prefix}/id"}
