"""The FastAPI application: create_app (routers, middleware, one error handler, lifespan) and serve()."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles

import agent
from agent import limits
from controller.errors import ControllerError
from controller.service import Controller
from controller.settings import Settings, ensure_home
from web import api, filters, hosts_page, metrics, pages, security
from web.middleware import BodyLimit, WebSecurity
from web.run_templates import TemplateStore

HERE = Path(__file__).parent


def _jinja() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # every template, whatever its extension; no |safe on data anywhere
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    filters.install(env)
    return env


def _allowed_hosts(bind: str, configured: Iterable[str]) -> frozenset[str]:
    names = {h.strip().lower() for h in configured if h.strip()}
    if not security.is_loopback(bind):
        names.update({socket.gethostname().lower(), socket.getfqdn().lower()})
        if bind not in ("0.0.0.0", "::", ""):
            names.add(bind.lower())
    return frozenset(names)


def create_app(
    controller: Controller,
    *,
    bind: str | None = None,
    require_auth: bool | None = None,
    manage_controller: bool = False,
) -> FastAPI:
    """Build the app around a Controller (started and stopped by its lifespan with ``manage_controller``)."""
    settings = controller.settings
    bind = bind or settings.bind
    auth = (not security.is_loopback(bind)) if require_auth is None else require_auth
    home: Path = settings.home
    ensure_home(home)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_controller:
            await controller.start()
        try:
            yield
        finally:
            if manage_controller:
                await controller.stop()

    app = FastAPI(
        title="eaglewatch",
        version=agent.__version__,
        description="Launch and watch EAGLE-3 hidden-state extraction runs.",
        lifespan=lifespan,
        docs_url=None,  # the Swagger page loads scripts from a CDN, which the CSP forbids
        redoc_url=None,
    )
    token_hash = security.load_token_hash(home)
    if auth and token_hash is None:
        raise RuntimeError(
            f"the web UI needs a login token but none is stored under {home}; run serve() first"
        )
    generation = security.token_generation(token_hash)
    app.state.controller = controller
    app.state.signer = security.Signer(security.load_secret(home), generation, ttl_s=settings.session_ttl_s)
    app.state.require_auth = auth
    app.state.token_checker = security.TokenChecker(token_hash)
    app.state.sessions = security.SessionTable(home / security.SESSIONS_FILE, generation)
    app.state.bind = bind
    app.state.login_links = security.LoginLinks()
    app.state.jinja = _jinja()
    app.state.template_store = TemplateStore(home)
    app.state.metrics = metrics.Metrics()
    app.add_middleware(BodyLimit, limit=limits.MAX_BODY_BYTES)  # inside WebSecurity: Host and login first
    app.state.allowed_hosts = _allowed_hosts(bind, settings.allowed_hosts)
    app.add_middleware(WebSecurity)  # reads what it needs from app.state
    for module in (api, pages, hosts_page):
        app.include_router(module.router)
        app.include_router(module.post_router)
    app.include_router(metrics.router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    _install_error_handlers(app)
    return app


def _error(request: Request, status: int, code: str, message: str, errors: Any = None) -> Response:
    path = request.url.path
    if not (path.startswith("/api/") or path in ("/metrics", "/openapi.json")):  # a page: an error page
        return pages.render(request, "error.html", status=status, code=code, message=message)
    body: dict[str, Any] = {"error": code, "message": message}
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    """One place turns typed errors into HTTP statuses (Datasette style)."""

    @app.exception_handler(ControllerError)
    async def controller_error(request: Request, exc: ControllerError) -> Response:
        return _error(request, exc.status, exc.code, exc.message, getattr(exc, "errors", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        errs = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header")]
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            errs.append({"field": ".".join(loc), "message": msg})
        text = "; ".join(f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in errs)
        return _error(request, 422, "invalid", text or "invalid input", errs)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        codes = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}
        return _error(request, exc.status_code, codes.get(exc.status_code, "error"), str(exc.detail))


def serve(settings: Settings, bind: str, port: int) -> None:
    """Run controller + web UI with uvicorn (``eaglewatch serve``); off loopback a login token is required."""
    import uvicorn

    ensure_home(settings.home)
    if not security.is_loopback(bind):
        token = security.ensure_token(settings.home)
        if token is not None:
            print(f"eaglewatch web login token (shown once, stored hashed): {token}", flush=True)
    app = create_app(Controller(settings), bind=bind, manage_controller=True)
    uvicorn.run(app, host=bind, port=port, log_level="info", proxy_headers=False)
