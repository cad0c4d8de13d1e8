"""The durable alert outbox: deliver due rows through apprise, retry with exponential backoff and jitter.

Rows live in SQLite (crud.raise_alert adds them), so an alert raised while the channel (or the controller)
was down is delivered later.  Each due row is claimed first: another controller process (the CLI beside
``serve``) may poll the same outbox.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from controller import crud, queries
from controller.settings import Settings
from controller.store import Store

log = logging.getLogger(__name__)


class OutboxWorker:
    """Delivers due outbox rows through apprise; failures back off exponentially (with jitter)."""

    def __init__(self, settings: Settings, store: Store, poll_s: float = 0.5) -> None:
        self.settings = settings
        self.store = store
        self.poll_s = poll_s

    async def run_forever(self) -> None:
        """Deliver until cancelled."""
        while True:
            try:
                await self.deliver_due()
            except Exception:
                log.exception("outbox: delivery round failed")
            await asyncio.sleep(self.poll_s)

    async def deliver_due(self) -> int:
        """One round: try every due row once; returns how many were delivered."""
        now = time.time()
        rows = await self.store.read(queries.due_outbox, now)
        delivered = 0
        for row in rows:
            delivered += await self._deliver(row, now)
        return delivered

    async def _deliver(self, row: dict[str, Any], now: float) -> bool:
        """Claim one due row, send it, record the outcome; True when delivered."""
        if not await self.store.write(lambda tx: crud.claim_outbox(tx=tx, outbox_id=row["id"], now=now)):
            return False
        ok, err = await self._send(row)
        if ok:
            await self.store.write(lambda tx: crud.outbox_delivered(tx=tx, row=row))
        else:
            delay = self._backoff(row["attempts"] + 1)
            await self.store.write(lambda tx: crud.outbox_failed(tx=tx, row=row, delay_s=delay, error=err))
        return ok

    def _backoff(self, attempts: int) -> float:
        return min(2.0**attempts, self.settings.outbox_max_backoff_s) * random.uniform(0.5, 1.0)

    async def _send(self, row: dict[str, Any]) -> tuple[bool, str | None]:
        urls = [u.get_secret_value() for u in self.settings.apprise_urls]
        if not urls:
            return False, "no apprise_urls configured"
        ap = _apprise(urls)
        title = f"eaglewatch [{row['severity']}] {row['rule']}"
        try:
            ok = bool(await ap.async_notify(body=row["message"], title=title))
        except Exception as exc:  # apprise plugins may raise on odd input; keep the row for retry
            return False, f"{type(exc).__name__}: {exc}"
        return ok, None if ok else "apprise could not deliver to every URL"


def _apprise(urls: list[str]) -> Any:
    """An Apprise object for ``urls``; apprise (heavy) is imported lazily, and its plugins, loaded on the
    first ``add``, import stdlib modules deprecated in 3.11 (imghdr): silence that here only."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import apprise

        ap = apprise.Apprise()
        for url in urls:
            ap.add(url)
    return ap
