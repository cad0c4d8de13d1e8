"""ASGI middleware: Host/Origin checks, session cookie, login gate, security headers, metrics, body limit."""

from __future__ import annotations

import json
from http.cookies import SimpleCookie
from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from web import security
from web.metrics import Metrics

_OPEN_PATHS = ("/login", "/static/", "/api/health")


class WebSecurity:
    """One pass over every HTTP request; rejects before the app runs, decorates responses after."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        signer: security.Signer,
        require_auth: bool,
        checker: security.TokenChecker,
        sessions: security.SessionTable,
        allowed_hosts: frozenset[str],
        metrics: Metrics | None = None,
        secure_cookie: bool = False,
    ) -> None:
        self.app = app
        self.signer = signer
        self.require_auth = require_auth
        self.checker = checker
        self.sessions = sessions
        self.allowed_hosts = allowed_hosts
        self.metrics = metrics
        self.secure_cookie = secure_cookie

    async def _bearer(self, header: str | None, client: str) -> security.Verdict:
        if not header or not header.lower().startswith("bearer "):
            return security.Verdict.BAD
        return await self.checker.check(header[7:].strip()[:512], client)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path: str = scope["path"]
        host = headers.get("host")
        if not security.host_allowed(host, self.allowed_hosts):
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
        session = self.signer.load(morsel.value if morsel else None)
        if session is not None and session.authed and not self.sessions.active(session):
            session = None  # logged out (or never logged in here): the cookie is void
        verdict = security.Verdict.BAD
        if "authorization" in headers:
            verdict = await self._bearer(headers["authorization"], client_of(scope))
        if verdict is security.Verdict.LIMITED:
            await _reject(
                send, 429, "rate_limited", "too many wrong tokens from this client; retry in a minute"
            )
            return
        bearer = verdict is security.Verdict.OK
        fresh = session is None
        if session is None:
            session = self.signer.new_session(authed=False)
        state = scope.setdefault("state", {})
        state["session"] = session
        state["bearer"] = bearer
        if self.require_auth and not (session.authed or bearer) and not path.startswith(_OPEN_PATHS):
            if path.startswith("/api/") or path == "/metrics" or path == "/openapi.json":
                await _reject(send, 401, "unauthorized", "log in or send 'Authorization: Bearer <token>'")
            else:
                await _redirect(send, "/login?next=" + quote(path, safe="/"))
            return
        set_cookie = security.session_cookie(self.signer, session, self.secure_cookie) if fresh else None
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
            if self.metrics is not None:
                route = scope.get("route")
                self.metrics.observe_request(
                    scope["method"], getattr(route, "path", "unmatched"), status_holder["status"]
                )


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
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 429:
        hdrs.append((b"retry-after", b"60"))
    hdrs += [(k.encode(), v.encode()) for k, v in security.SECURITY_HEADERS.items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def _redirect(send: Send, location: str) -> None:
    hdrs = [(b"location", location.encode("latin-1")), (b"content-length", b"0")]
    hdrs += [(k.encode(), v.encode()) for k, v in security.SECURITY_HEADERS.items()]
    await send({"type": "http.response.start", "status": 303, "headers": hdrs})
    await send({"type": "http.response.body", "body": b""})
