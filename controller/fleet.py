"""All host supervisors of one process, one-shot links for processes that do not supervise, and the
periodic sweep that raises alerts on absence (host unreachable too long, stalled runs)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from controller import alerts, queries
from controller.bootstrap import fetch_host_key, open_link
from controller.errors import HostKeyRejected, Unreachable
from controller.link import Link
from controller.settings import Settings
from controller.store import Store, Tx
from controller.supervisor import HostSupervisor

log = logging.getLogger(__name__)


class Supervisors:
    """All host supervisors of this process, plus one-shot links for processes that do not supervise."""

    def __init__(
        self, settings: Settings, store: Store, *, supervise: bool = True, only_hosts: list[str] | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        self.supervise = supervise
        self.only_hosts = only_hosts
        self.hosts: dict[str, HostSupervisor] = {}
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start a supervisor per host (or per host in ``only_hosts``) and the alert sweep."""
        for host in await self.store.read(queries.list_hosts):
            if self.only_hosts is None or host.name in self.only_hosts:
                await self.ensure(host.name)
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="alert-sweep")

    async def ensure(self, name: str) -> None:
        """Supervise ``name`` if not already."""
        if self.supervise and name not in self.hosts:
            sup = HostSupervisor(name, self.settings, self.store)
            self.hosts[name] = sup
            sup.start()

    async def drop(self, name: str) -> None:
        """Stop supervising a removed host."""
        sup = self.hosts.pop(name, None)
        if sup is not None:
            await sup.stop()

    async def stop(self) -> None:
        """Stop every supervisor and the sweep."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sweeper
        for name in list(self.hosts):
            await self.drop(name)

    def poke(self, name: str) -> None:
        """Tell a host's supervisor to pick up new runs now."""
        sup = self.hosts.get(name)
        if sup is not None:
            sup.poke()

    @contextlib.asynccontextmanager
    async def link_for(self, name: str) -> AsyncIterator[Link]:
        """The supervised live link when up, else a one-shot link closed afterwards (Unreachable if down)."""
        sup = self.hosts.get(name)
        if sup is not None and sup.link is not None and not sup.link.closed.is_set():
            yield sup.link
            return
        host = await self.store.read(queries.host_row, name)
        link, _ = await open_link(host, self.settings, None)
        try:
            yield link
        finally:
            await link.close()

    async def check(self, name: str) -> None:
        """Connect now and refresh the host's version and GPUs (raises Unreachable/HostKeyRejected)."""
        tmp = HostSupervisor(name, self.settings, self.store)
        host = await self.store.read(queries.host_row, name)
        try:
            link, fp = await open_link(host, self.settings, None)
        except Unreachable as exc:
            if isinstance(exc, HostKeyRejected):
                await tmp._key_rejected(exc)
            message = exc.message
            await self.store.write(lambda tx: _set_error(tx, name, message))
            raise
        try:
            await tmp._connected(link, fp)
        finally:
            await link.close()

    async def fetch_fingerprint(self, dest: str) -> str:
        """Host key fingerprint presented at ``dest``."""
        return await fetch_host_key(dest, self.settings)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self.store.write(self._sweep)
            except Exception:
                log.exception("alert sweep failed")

    def _sweep(self, tx: Tx) -> None:
        s, now = self.settings, time.time()
        deliver = bool(s.apprise_urls)
        for h in tx.conn.execute("SELECT name, unreachable_since FROM hosts WHERE reachable=0").fetchall():
            if self.only_hosts is not None and h[0] not in self.only_hosts:
                continue
            d = alerts.host_unreachable(h[0], h[1], now, s.unreachable_minutes)
            if d:
                alerts.raise_alert(tx, d, cooldown_s=s.cooldown_s, deliver=deliver)
        for r in tx.conn.execute("SELECT * FROM runs WHERE state='running'").fetchall():
            d = alerts.stall(dict(r), now, s.stall_factor, s.stall_min_s)
            if d:
                alerts.raise_alert(tx, d, cooldown_s=s.cooldown_s, deliver=deliver)


def _set_error(tx: Tx, name: str, message: str) -> None:
    tx.conn.execute(
        "UPDATE hosts SET reachable=0, last_error=?, unreachable_since=coalesce(unreachable_since, ?)"
        " WHERE name=?",
        (message, tx.now, name),
    )
    tx.host_changed(name)
