"""All host supervisors of one process, one-shot links and catch-ups (``refresh``) for processes that do not
supervise, and the periodic sweep that raises alerts on absence (host unreachable too long, stalled runs)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from controller import crud, queries
from controller.alerts import AlertPolicy
from controller.bootstrap import open_link
from controller.errors import AgentError, ControllerError, HostKeyRejected, NotFound, Unreachable
from controller.link import Link
from controller.settings import Settings
from controller.store import Store
from controller.supervisor import HostSupervisor

log = logging.getLogger(__name__)
#: How long a CLI command waits for one host before answering from what is stored.
REFRESH_TIMEOUT_S = 15.0
#: Journal caught up and the log offset unchanged this long: the rest is a line still being written.
LOG_SETTLE_S = 1.0


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

    async def refresh(self, name: str, timeout: float) -> Freshness:
        """Catch ``name``'s runs up from its agent's journal within ``timeout`` seconds (for processes that
        do not supervise): a one-shot link does what a supervisor does on connect, waits until the store
        holds everything the agent's ``status`` reported, and closes.  A host not reached in time is
        reported with the error and when it was last heard; nothing is marked unreachable, since a running
        ``serve`` may well have a good link of its own."""
        sup = HostSupervisor(name, self.settings, self.store, self.policy)
        link: Link | None = None
        try:
            async with asyncio.timeout(timeout):
                host = await self.store.read(queries.host_row, name)
                link, fp = await open_link(host, self.settings, sup.on_stream)
                await sup.connected_to(link, fp)
                await sup.catch_up_once(link)
                await _wait_caught_up(sup, link)
        except TimeoutError:
            return await _stale(self.store, name, f"no complete answer within {timeout:.0f} s")
        except ControllerError as exc:
            return await _stale(self.store, name, exc.message)
        except OSError as exc:
            return await _stale(self.store, name, f"{type(exc).__name__}: {exc}")
        finally:
            if link is not None:
                await link.close()
        return Freshness(name, True)

    async def _sweep_forever(self) -> None:
        sweep = partial(crud.sweep, policy=self.policy, settings=self.settings, only_hosts=self.only_hosts)
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self.store.write(sweep)
            except Exception:
                log.exception("alert sweep failed")


@dataclass(frozen=True)
class Freshness:
    """Whether a host's runs were caught up just now; if not, why, and when it was last heard."""

    host: str
    ok: bool
    error: str | None = None
    last_seen: float | None = None

    def describe(self) -> str:
        """One plain sentence for a user (empty when the host answered)."""
        if self.ok:
            return ""
        heard = "never heard from"
        if self.last_seen is not None:
            ago = max(0.0, time.time() - self.last_seen)
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.last_seen))
            heard = f"last heard {_ago(ago)} ago ({when})"
        return f"host {self.host}: not reachable now ({self.error}); {heard}: showing what was stored then"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


async def _wait_caught_up(sup: HostSupervisor, link: Link) -> None:
    """Wait until every followed run's stored seq and log offset reach what the agent reports now."""
    for run_id in sorted(sup.following):
        try:
            status = await link.request("status", run=run_id, timeout=10)
        except AgentError:
            continue
        want_seq, want_log = int(status.get("last_seq") or 0), int(status.get("log_size") or 0)
        last_offset, still_since = -1, time.monotonic()
        while True:
            row = await sup.store.read(queries.run_row, run_id)
            if row["last_seq"] >= want_seq:
                if row["log_offset"] >= want_log:
                    break
                # An unterminated last line is held back by the agent, so the offset may stop short.
                if row["log_offset"] != last_offset:
                    last_offset, still_since = row["log_offset"], time.monotonic()
                elif time.monotonic() - still_since > LOG_SETTLE_S:
                    break
            if link.closed.is_set():
                raise ControllerError(f"link closed while catching up: {link.close_reason}")
            await asyncio.sleep(0.05)


async def _stale(store: Store, name: str, error: str) -> Freshness:
    try:
        host = await store.read(queries.host_row, name)
    except NotFound:
        return Freshness(name, False, error)
    return Freshness(name, False, error, host.get("last_seen"))
