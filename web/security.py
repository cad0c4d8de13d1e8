"""Web security: access token (stored hashed), signed session cookie, CSRF tokens, login links, Host/Origin.

- Every browser gets a signed session cookie ``ew_session`` (HttpOnly, SameSite=Strict): session id,
  logged in or not, expiry. Its MAC (secret in ``<home>/web-secret``) also covers the token's generation,
  so a new token voids every cookie issued under the old one. A logged-in session must also be listed in
  ``SessionTable`` (``<home>/web-sessions.json``, 0600, digests only): logout really revokes a cookie.
- A session's CSRF token is ``HMAC(secret, "csrf|" + sid)``, embedded in forms and a ``<meta>`` tag; every
  POST carries it, except one with ``Authorization: Bearer <token>`` (browsers never add that on their own).
- Off loopback a login is required: the token is printed once, only its scrypt hash is kept
  (``<home>/web-token.json``). scrypt checks run in one worker thread, never on the event loop the SSH
  links share; each client gets ``ATTEMPTS_PER_MINUTE`` checks of unknown tokens a minute, then 429.
- ``Host`` must be an IP literal, ``localhost`` or a configured name (against DNS rebinding); a POST whose
  ``Origin`` differs from ``Host`` is refused.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import math
import os
import secrets
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from urllib.parse import urlsplit

SESSION_COOKIE = "ew_session"
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"
TOKEN_FILE = "web-token.json"
SECRET_FILE = "web-secret"
SESSIONS_FILE = "web-sessions.json"
SESSION_TTL_S = 12 * 3600.0
ATTEMPTS_PER_MINUTE = 10
#: How long a printed login link stays valid.
LINK_TTL_S = 900.0

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
}

_SCRYPT = {"n": 2**14, "r": 8, "p": 1}


def is_loopback(bind: str) -> bool:
    """True when ``bind`` only accepts connections from this machine."""
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return False


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable only by its owner (created 0600 before any byte lands)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a stale temp file keeps its old mode through O_CREAT
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def load_secret(home: Path) -> bytes:
    """The cookie-signing secret under ``home``, created on first use."""
    path = home / SECRET_FILE
    if path.exists():
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    data = secrets.token_bytes(32)
    write_private(path, data)
    return data


def hash_token(token: str, salt: bytes | None = None) -> dict[str, str]:
    """A storable scrypt hash of ``token``."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(token.encode(), salt=salt, **_SCRYPT)
    return {
        "algo": "scrypt",
        "salt": base64.b64encode(salt).decode(),
        "hash": base64.b64encode(digest).decode(),
    }


def verify_token(token: str, stored: dict[str, str]) -> bool:
    """Constant-time check of ``token`` against a stored hash."""
    if stored.get("algo") != "scrypt" or not token:
        return False
    try:
        salt = base64.b64decode(stored["salt"])
        expected = base64.b64decode(stored["hash"])
    except (KeyError, ValueError):
        return False
    digest = hashlib.scrypt(token.encode(), salt=salt, **_SCRYPT)
    return hmac.compare_digest(digest, expected)


def ensure_token(home: Path) -> str | None:
    """Create the access token if none is stored; return it (to print once) or None if one exists."""
    path = home / TOKEN_FILE
    if path.exists():
        return None
    token = secrets.token_urlsafe(24)
    write_private(path, json.dumps(hash_token(token)).encode())
    return token


def load_token_hash(home: Path) -> dict[str, str] | None:
    """The stored token hash, or None when no token was ever generated."""
    path = home / TOKEN_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def token_generation(stored: dict[str, str] | None) -> str:
    """A short digest of the stored token hash: changes whenever the token is replaced."""
    if stored is None:
        return ""
    return hashlib.sha256(json.dumps(stored, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Session:
    """A decoded session cookie."""

    sid: str
    authed: bool
    expires: int


class Signer:
    """Signs and verifies session cookies and derives per-session CSRF tokens."""

    def __init__(self, secret: bytes, generation: str = "", ttl_s: float = SESSION_TTL_S) -> None:
        self._secret = secret
        self._generation = generation
        self.ttl_s = ttl_s

    def _mac(self, msg: str) -> str:
        return hmac.new(self._secret, msg.encode(), hashlib.sha256).hexdigest()

    def new_session(self, authed: bool, now: float | None = None) -> Session:
        """A fresh session (rotated at login so a planted cookie cannot be promoted)."""
        expires = math.ceil((time.time() if now is None else now) + self.ttl_s)
        return Session(sid=secrets.token_urlsafe(18), authed=authed, expires=expires)

    def _body_mac(self, body: str) -> str:
        return self._mac(f"session|{self._generation}|{body}")

    def dump(self, session: Session) -> str:
        """Cookie value for ``session``."""
        body = f"{session.sid}.{1 if session.authed else 0}.{session.expires}"
        return f"{body}.{self._body_mac(body)}"

    def load(self, value: str | None, now: float | None = None) -> Session | None:
        """Decode a cookie value; None when absent, malformed, forged, of an old token or expired."""
        if not value or value.count(".") != 3 or len(value) > 256:
            return None
        sid, flag, expires, mac = value.split(".")
        body = f"{sid}.{flag}.{expires}"
        if flag not in ("0", "1") or not expires.isdigit() or len(expires) > 12:
            return None
        if not hmac.compare_digest(mac, self._body_mac(body)):
            return None
        if int(expires) <= (time.time() if now is None else now):
            return None
        return Session(sid=sid, authed=flag == "1", expires=int(expires))

    def csrf_token(self, session: Session) -> str:
        """The CSRF token bound to ``session``."""
        return self._mac("csrf|" + session.sid)[:40]

    def check_csrf(self, session: Session | None, token: str | None) -> bool:
        """True when ``token`` is the CSRF token of ``session``."""
        if session is None or not token:
            return False
        return hmac.compare_digest(token, self.csrf_token(session))


class SessionTable:
    """Logged-in sessions kept server-side (digests of their ids → expiry), so logout really revokes.

    Persisted to ``<home>/web-sessions.json`` (0600) so a restart keeps people logged in; a file written
    under another token generation is ignored, which logs everyone out when the token is replaced.
    """

    MAX_SESSIONS = 10000

    def __init__(self, path: Path, generation: str) -> None:
        self.path = path
        self.generation = generation
        self._lock = threading.Lock()
        self._live: dict[str, int] = self._read()

    def _read(self) -> dict[str, int]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("generation") != self.generation:
            return {}
        live = data.get("sessions")
        if not isinstance(live, dict):
            return {}
        return {str(k): int(v) for k, v in live.items() if isinstance(v, int) and v > time.time()}

    def _save(self) -> None:
        data = {"generation": self.generation, "sessions": self._live}
        write_private(self.path, json.dumps(data).encode())

    @staticmethod
    def _key(sid: str) -> str:
        # only digests are stored: the file alone does not let anyone forge or replay a session
        return hashlib.sha256(sid.encode()).hexdigest()

    def add(self, session: Session, now: float | None = None) -> None:
        """Record a logged-in session (dropping expired ones and, past the cap, those expiring first)."""
        now = time.time() if now is None else now
        with self._lock:
            self._live = {k: v for k, v in self._live.items() if v > now}
            self._live[self._key(session.sid)] = session.expires
            if len(self._live) > self.MAX_SESSIONS:
                keep = sorted(self._live.items(), key=lambda kv: kv[1])[-self.MAX_SESSIONS :]
                self._live = dict(keep)
            self._save()

    def active(self, session: Session, now: float | None = None) -> bool:
        """True while ``session`` is logged in here and not expired."""
        expires = self._live.get(self._key(session.sid))
        return expires is not None and expires > (time.time() if now is None else now)

    def revoke(self, session: Session) -> None:
        """Forget ``session`` (logout): its cookie no longer logs anyone in."""
        with self._lock:
            if self._live.pop(self._key(session.sid), None) is not None:
                self._save()


class Verdict(Enum):
    """Outcome of one token check."""

    OK = "ok"
    BAD = "bad"
    LIMITED = "limited"


class AttemptLimiter:
    """At most ``limit`` token checks per client in a sliding ``window_s`` (successful ones refunded)."""

    MAX_CLIENTS = 4096

    def __init__(self, limit: int = ATTEMPTS_PER_MINUTE, window_s: float = 60.0) -> None:
        self.limit = limit
        self.window_s = window_s
        self._seen: OrderedDict[str, deque[float]] = OrderedDict()

    def acquire(self, client: str, now: float | None = None) -> bool:
        """Count one attempt for ``client``; False (nothing counted) when it is over its limit."""
        now = time.monotonic() if now is None else now
        times = self._seen.pop(client, None) or deque()
        while times and times[0] <= now - self.window_s:
            times.popleft()
        self._seen[client] = times
        while len(self._seen) > self.MAX_CLIENTS:
            self._seen.popitem(last=False)  # the least recently seen client goes first
        if len(times) >= self.limit:
            return False
        times.append(now)
        return True

    def refund(self, client: str) -> None:
        """Give back the latest attempt of ``client`` (it turned out to be the right token)."""
        times = self._seen.get(client)
        if times:
            times.pop()


# One thread for all scrypt work: a flood queues here instead of taking the event loop or every core.
_SCRYPT_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-check")


class TokenChecker:
    """Checks presented tokens off the event loop, with caches of good and bad ones and a per-client limit."""

    BAD_CACHE = 4096

    def __init__(self, stored: dict[str, str] | None) -> None:
        self.stored = stored
        self.limiter = AttemptLimiter()
        self._good: set[str] = set()
        self._bad: OrderedDict[str, None] = OrderedDict()

    async def check(self, token: str, client: str) -> Verdict:
        """OK, BAD, or LIMITED when ``client`` used up its attempts (then nothing was verified)."""
        if self.stored is None:
            return Verdict.BAD  # no token was ever made (loopback): nothing to guess, nothing to limit
        key = hashlib.sha256(token.encode()).hexdigest()
        if key in self._good:
            return Verdict.OK
        if not self.limiter.acquire(client):
            return Verdict.LIMITED
        if not token or key in self._bad:
            return Verdict.BAD
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(_SCRYPT_POOL, verify_token, token, self.stored)
        if ok:
            self._good.add(key)
            self.limiter.refund(client)
            return Verdict.OK
        self._bad[key] = None
        while len(self._bad) > self.BAD_CACHE:
            self._bad.popitem(last=False)
        return Verdict.BAD


def host_allowed(host_header: str | None, allowed_names: frozenset[str]) -> bool:
    """Host header check against DNS rebinding: IP literals, localhost and configured names pass."""
    if not host_header:
        return False
    try:
        name = urlsplit("//" + host_header).hostname
    except ValueError:
        return False
    if not name:
        return False
    name = name.lower().rstrip(".")
    if name == "localhost" or name in allowed_names:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def origin_matches(origin: str | None, host_header: str | None) -> bool:
    """True when there is no Origin (non-browser client) or it names the same host:port as ``Host``."""
    if origin is None:
        return True
    if origin == "null" or not host_header:
        return False
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host_header.lower()


def session_cookie(signer: Signer, session: Session) -> str:
    """A Set-Cookie header value for ``session``: HttpOnly, SameSite=Strict, Max-Age."""
    max_age = max(1, math.ceil(session.expires - time.time()))  # 0 would tell the browser to drop it
    return f"{SESSION_COOKIE}={signer.dump(session)}; Path=/; Max-Age={max_age}; HttpOnly; SameSite=Strict"


class LoginLinks:
    """One-time login links (the demo prints ``/login/link?code=…``): codes kept as digests, in memory (a
    restart voids them), each working once within ``ttl_s``."""

    def __init__(self, ttl_s: float = LINK_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()

    def issue(self) -> str:
        """A new single-use code."""
        code = secrets.token_urlsafe(24)
        with self._lock:
            self._expiry[hashlib.sha256(code.encode()).hexdigest()] = time.monotonic() + self.ttl_s
        return code

    def redeem(self, code: str) -> bool:
        """True once for a code issued here and not yet expired; it is forgotten either way."""
        now = time.monotonic()
        with self._lock:
            self._expiry = {d: t for d, t in self._expiry.items() if t > now}
            return self._expiry.pop(hashlib.sha256(code.encode()).hexdigest(), None) is not None
