"""All host supervisors of one process, one-shot links for processes that do not supervise, and the
periodic sweep that raises alerts on absence (host unreachable too long, stalled runs)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from controller import crud, queries
from controller.alerts import AlertPolicy
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
        self,
        settings: Settings,
        store: Store,
        policy: AlertPolicy,
        *,
        supervise: bool = True,
        only_hosts: list[str] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.policy = policy
        self.supervise = supervise
        self.only_hosts = only_hosts
        self.hosts: dict[str, HostSupervisor] = {}
        #: (route, reason) of each host's latest ``check`` link (a one-shot supervisor's).
        self._checked: dict[str, tuple[str, str]] = {}
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
            sup = HostSupervisor(name, self.settings, self.store, self.policy)
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
        tmp = HostSupervisor(name, self.settings, self.store, self.policy)
        host = await self.store.read(queries.host_row, name)
        try:
            link, fp = await open_link(host, self.settings, None)
        except Unreachable as exc:
            if isinstance(exc, HostKeyRejected):
                await tmp.key_rejected(exc)
            message = exc.message
            await self.store.write(lambda tx: crud.host_unreachable(tx=tx, name=name, reason=message))
            raise
        try:
            await tmp.connected_to(link, fp)
        finally:
            await link.close()
        if tmp.route is not None:
            self._checked[name] = tmp.route

    def route_of(self, name: str) -> tuple[str, str] | None:
        """(route, reason) of the latest link to ``name``: the supervised one, else the latest check's."""
        sup = self.hosts.get(name)
        if sup is not None and sup.route is not None:
            return sup.route
        return self._checked.get(name)

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
        s = self.settings
        crud.sweep(
            tx=tx,
            policy=self.policy,
            unreachable_minutes=s.unreachable_minutes,
            stall_factor=s.stall_factor,
            stall_min_s=s.stall_min_s,
            only_hosts=self.only_hosts,
        )
