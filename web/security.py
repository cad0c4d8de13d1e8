"""Web security: access token (stored hashed), signed session cookie, CSRF tokens, Host/Origin checks, CSP.

How it works
------------
- Every browser gets a signed session cookie ``ew_session`` (HttpOnly, SameSite=Strict) holding a random
  session id and whether the session has logged in. The signing secret lives in ``<home>/web-secret``.
- The CSRF token of a session is ``HMAC(secret, "csrf|" + sid)``: pages embed it in every form and in a
  ``<meta>`` tag that the JS sends back as ``X-CSRF-Token``; every POST must carry it (per-session token).
- When the UI is bound to anything but loopback a login is required: the token is generated once, printed
  once, and only its scrypt hash is kept in ``<home>/web-token.json``. Requests may also carry
  ``Authorization: Bearer <token>`` (scripts); such requests need no CSRF token since browsers never add
  that header on their own.
- ``Host`` must be an IP literal, ``localhost`` or a configured name: a DNS-rebinding page reaches us under
  its own domain name and is refused. A POST whose ``Origin`` differs from ``Host`` is refused.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

SESSION_COOKIE = "ew_session"
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"
TOKEN_FILE = "web-token.json"
SECRET_FILE = "web-secret"

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


def _write_private(path: Path, data: bytes) -> None:
    """Write a file readable only by its owner (created 0600 before any byte lands)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
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
    _write_private(path, data)
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
    _write_private(path, json.dumps(hash_token(token)).encode())
    return token


def load_token_hash(home: Path) -> dict[str, str] | None:
    """The stored token hash, or None when no token was ever generated."""
    path = home / TOKEN_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Session:
    """A decoded session cookie."""

    sid: str
    authed: bool


class Signer:
    """Signs and verifies session cookies and derives per-session CSRF tokens."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, msg: str) -> str:
        return hmac.new(self._secret, msg.encode(), hashlib.sha256).hexdigest()

    def new_session(self, authed: bool) -> Session:
        """A fresh session (rotated at login so a planted cookie cannot be promoted)."""
        return Session(sid=secrets.token_urlsafe(18), authed=authed)

    def dump(self, session: Session) -> str:
        """Cookie value for ``session``."""
        body = f"{session.sid}.{1 if session.authed else 0}"
        return f"{body}.{self._mac('session|' + body)}"

    def load(self, value: str | None) -> Session | None:
        """Decode a cookie value; None when absent, malformed or forged."""
        if not value or value.count(".") != 2:
            return None
        sid, flag, mac = value.split(".")
        body = f"{sid}.{flag}"
        if flag not in ("0", "1") or not hmac.compare_digest(mac, self._mac("session|" + body)):
            return None
        return Session(sid=sid, authed=flag == "1")

    def csrf_token(self, session: Session) -> str:
        """The CSRF token bound to ``session``."""
        return self._mac("csrf|" + session.sid)[:40]

    def check_csrf(self, session: Session | None, token: str | None) -> bool:
        """True when ``token`` is the CSRF token of ``session``."""
        if session is None or not token:
            return False
        return hmac.compare_digest(token, self.csrf_token(session))


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


def session_cookie(signer: Signer, session: Session, secure: bool = False) -> str:
    """A Set-Cookie header value for ``session``: HttpOnly, SameSite=Strict (Secure behind TLS)."""
    flags = "; Path=/; HttpOnly; SameSite=Strict" + ("; Secure" if secure else "")
    return f"{SESSION_COOKIE}={signer.dump(session)}{flags}"
