"""One-time login links: a code in a URL that logs a browser in once, then is forgotten.

The demo prints ``<url>/login/link?code=…`` so a newcomer lands logged in.  Only a digest of each code is
kept, in memory (a restart voids every link); a code works once and expires after ``ttl_s``.  The page
exchanges it for the same session cookie the token login sets and redirects to a clean URL, so the code
does not stay in the address bar or the history.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time

#: How long a printed link stays valid.
LINK_TTL_S = 900.0


def _digest(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


class LoginLinks:
    """Issued codes (as digests) and when each expires."""

    def __init__(self, ttl_s: float = LINK_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()

    def issue(self) -> str:
        """A new single-use code."""
        code = secrets.token_urlsafe(24)
        with self._lock:
            self._expiry[_digest(code)] = time.monotonic() + self.ttl_s
        return code

    def redeem(self, code: str) -> bool:
        """True once for a code issued here and not yet expired; it is forgotten either way."""
        now = time.monotonic()
        with self._lock:
            self._expiry = {d: t for d, t in self._expiry.items() if t > now}
            return self._expiry.pop(_digest(code), None) is not None
