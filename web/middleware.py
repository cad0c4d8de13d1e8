"""The request gate: ASGI middleware (Host/Origin, session cookie, login, security headers, metrics, body
limit) and the FastAPI dependencies behind it (controller, CSRF enforcement, templates)."""

from __future__ import annotations

import json
from http.cookies import SimpleCookie
from typing import Annotated
from urllib.parse import quote

from fastapi import Depends, HTTPException, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.service import Controller
from web import security
from web.run_templates import TemplateStore

_OPEN_PATHS = ("/login", "/static/", "/api/health")


class WebSecurity:
    """One pass over every HTTP request; rejects before the app runs, decorates responses after."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path: str = scope["path"]
        host = headers.get("host")
        web = scope["app"].state  # set by create_app: signer, sessions, token checker, allowed hosts…
        if not security.host_allowed(host, web.allowed_hosts):
            await _reject(send, 400, "bad_host", f"Host header {(host or '')[:80]!r} is not allowed")
            return
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            if not security.origin_matches(headers.get("origin"), host):
                await _reject(send, 403, "bad_origin", "cross-origin request refused")
                return
            if headers.get("sec-fetch-site") == "cross-site":
                await _reject(send, 403, "bad_origin", "cross-site request refused")
                return
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed Cookie header is ignored like a missing one
            cookie = SimpleCookie()
        morsel = cookie.get(security.SESSION_COOKIE)
        session = web.signer.load(morsel.value if morsel else None)
        if session is not None and session.authed and not web.sessions.active(session):
            session = None  # logged out (or never logged in here): the cookie is void
        verdict = security.Verdict.BAD
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            verdict = await web.token_checker.check(auth[7:].strip()[:512], client_of(scope))
        if verdict is security.Verdict.LIMITED:
            await _reject(
                send, 429, "rate_limited", "too many wrong tokens from this client; retry in a minute"
            )
            return
        bearer = verdict is security.Verdict.OK
        fresh = session is None
        if session is None:
            session = web.signer.new_session(authed=False)
        state = scope.setdefault("state", {})
        state["session"] = session
        state["bearer"] = bearer
        if web.require_auth and not (session.authed or bearer) and not path.startswith(_OPEN_PATHS):
            if path.startswith("/api/") or path == "/metrics" or path == "/openapi.json":
                await _reject(send, 401, "unauthorized", "log in or send 'Authorization: Bearer <token>'")
            else:
                location = "/login?next=" + quote(path, safe="/")
                await _send(send, 303, [(b"location", location.encode("latin-1"))], b"")
            return
        set_cookie = security.session_cookie(web.signer, session) if fresh else None
        status_holder = {"status": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_holder["status"] = message["status"]
                hdrs = list(message.get("headers", []))
                names = {k.lower() for k, _ in hdrs}
                for name, value in security.SECURITY_HEADERS.items():
                    if name.encode() not in names:
                        hdrs.append((name.encode(), value.encode()))
                already = any(
                    k.lower() == b"set-cookie" and v.startswith(security.SESSION_COOKIE.encode() + b"=")
                    for k, v in hdrs
                )
                if set_cookie and not already:
                    hdrs.append((b"set-cookie", set_cookie.encode("latin-1")))
                message = {**message, "headers": hdrs}
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            web.metrics.observe_request(scope["method"], route, status_holder["status"])


class BodyLimit:
    """Answers 413 to a request body over ``limit`` bytes, having read at most ``limit`` bytes of it."""

    def __init__(self, app: ASGIApp, *, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lengths = [v for k, v in scope["headers"] if k.lower() == b"content-length"]
        if lengths:
            try:
                declared = int(lengths[0])
            except ValueError:
                await _reject(send, 400, "bad_request", "Content-Length is not a number")
                return
            if declared > self.limit:
                await _reject(send, 413, "too_large", self._message(f"{declared} bytes"))
                return
            # The server frames the body by Content-Length: no more than that can arrive.
            await self.app(scope, receive, send)
            return
        # No length given (chunked): read up to the limit here, then hand the app what was read.
        held: list[Message] = []
        total = 0
        while True:
            message = await receive()
            held.append(message)
            if message["type"] != "http.request":
                break
            total += len(message.get("body", b""))
            if total > self.limit:
                await _reject(send, 413, "too_large", self._message(f"over {self.limit} bytes"))
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return held.pop(0) if held else await receive()

        await self.app(scope, replay, send)

    def _message(self, size: str) -> str:
        return (
            f"request body of {size} exceeds the limit of {self.limit} bytes "
            "(one agent protocol line: a larger run spec could never be launched)"
        )


def client_of(scope: Scope) -> str:
    """The peer address a request came from (what rate limits are keyed on)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


async def _reject(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": code, "message": message}).encode()
    hdrs = [(b"content-type", b"application/json")] + ([(b"retry-after", b"60")] if status == 429 else [])
    await _send(send, status, hdrs, body)


async def _send(send: Send, status: int, hdrs: list[tuple[bytes, bytes]], body: bytes) -> None:
    hdrs = [*hdrs, (b"content-length", str(len(body)).encode())]
    hdrs += [(k.encode(), v.encode()) for k, v in security.SECURITY_HEADERS.items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def get_controller(request: Request) -> Controller:
    """The Controller facade this app serves."""
    return request.app.state.controller


def get_csrf_token(request: Request) -> str:
    """The CSRF token pages embed in forms and in ``<meta name="csrf-token">``."""
    return request.app.state.signer.csrf_token(request.state.session)


async def require_csrf(request: Request) -> None:
    """Refuse a state-changing request without this session's CSRF token (header or form field)."""
    if request.state.bearer:
        return  # Authorization headers are never added by a browser on its own: no CSRF risk
    token = request.headers.get(security.CSRF_HEADER)
    ctype = request.headers.get("content-type", "")
    if token is None and ctype.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
        value = (await request.form()).get(security.CSRF_FIELD)
        token = value if isinstance(value, str) else None
    if not request.app.state.signer.check_csrf(request.state.session, token):
        raise HTTPException(status_code=403, detail="missing or wrong CSRF token (reload the page and retry)")


def get_template_store(request: Request) -> TemplateStore:
    """Saved run templates under EAGLEWATCH_HOME."""
    return request.app.state.template_store


ControllerDep = Annotated[Controller, Depends(get_controller)]
CsrfTokenDep = Annotated[str, Depends(get_csrf_token)]
TemplateStoreDep = Annotated[TemplateStore, Depends(get_template_store)]
CSRF_REQUIRED = [Depends(require_csrf)]
