"""The controller facade: one ``Controller`` per process; the web and the CLI use only this.

Interface (stable; the web builds on it)::

    ctl = Controller(settings, supervise=True)   # supervise=False: short-lived CLI, links opened on demand;
                                                  # only_hosts=[...] limits supervision; deliver_alerts=bool
    await ctl.start() / await ctl.stop()          # or: async with Controller(settings) as ctl
    ctl.settings: Settings ; ctl.bus: Bus         # ctl.bus.subscribe() -> async iterator of BusEvent

    await ctl.add_host(HostCreate) -> HostPublic   (Conflict if the name exists; SpecInvalid for bad input)
    await ctl.list_hosts() -> list[HostPublic] ; await ctl.get_host(name) -> HostPublic (NotFound)
    await ctl.remove_host(name) -> None (Conflict while it has non-terminal runs)
    await ctl.check_host(name) -> HostPublic      (connects now; Unreachable / HostKeyRejected on failure)
    await ctl.host_key(name) -> str               (SHA256 fingerprint the host presents; no trust implied)

    await ctl.create_run(spec: RunSpec) -> str   (run id; the spec validated where it came in: the API's
                                                  body, the web form, the CLI's models.parse_run_spec;
                                                  SpecInvalid(errors=[{field, message}]) for what only
                                                  its hosts tell: an unknown host, too few GPUs)
    await ctl.resume_run(run_id) -> str   (a new run, same spec, ``resumed_from`` = run_id; Conflict unless a
                                           failed/stopped/lost extraction)
    await ctl.stop_run(run_id) -> RunPublic
    await ctl.list_runs(limit=None, offset=0) -> list[RunPublic] (newest first)
    await ctl.count_runs() -> int
    await ctl.gc(older_than_s) -> {"runs", "lines", "bytes_before", "bytes_after"}   (drops ended runs' log
                                   lines, keeps milestones/verdicts/problems/specs, vacuums)
    await ctl.get_run(run_id) -> RunDetail
    await ctl.refresh(hosts, timeout=15) -> list[Freshness]   (catch runs up from the hosts' journals now;
                                                               for processes that do not supervise)
    await ctl.read_log(run_id, *, after_offset=-1, limit=1000, query=None, errors_only=False,
                       before_offset=None)
        -> list[{"offset": int, "text": str}]   (the first ``limit`` lines with offset > after_offset,
           ascending; with before_offset: the LAST ``limit`` lines with offset < before_offset, ascending)
    await ctl.list_alerts() -> list[AlertPublic] (newest first) ; await ctl.ack_alert(id) / mute_alert(id)
        -> AlertPublic
    await ctl.feed_since(run_id | None, cursor | None, limit=1000) -> list[BusEvent]

BusEvent kinds and ``data``:
    "run"       RunPublic as a dict (after every state/progress change the controller commits)
    "milestone" {"seq", "kind", "at", "line", "rank", "fields", "text"}
    "check"     {"seq", "at", "file", "ok", "format", "problems": [{code, file, message}]}
    "alert"     AlertPublic as a dict
    "log"       {"offset", "next_offset", "text", "offsets"}  (a block of one run's lines, their texts joined
                by newlines: controller/logblocks.py; ``lines_data`` gives [{"offset", "text"}, ...])
    "host"      HostPublic as a dict (run_id None)
``cursor`` is an opaque string, ordered (string comparison) in commit order; ``feed_since(run, cursor)``
returns everything committed after it (for SSE ``Last-Event-ID`` resume).  Errors are the typed
``controller.errors`` classes, each with an HTTP ``status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from agent.spec import RunSpec
from controller import crud, queries
from controller.alerts import AlertPolicy
from controller.bus import Bus, BusEvent
from controller.fleet import Supervisors
from controller.models import AlertPublic, HostCreate, HostPublic, RunDetail, RunPublic
from controller.outbox import OutboxWorker
from controller.refresh import REFRESH_TIMEOUT_S, Freshness, refresh_host
from controller.runs import RunOps
from controller.settings import Settings, ensure_home
from controller.store import Store

log = logging.getLogger(__name__)
#: How often the ``log_retention_days`` schedule runs gc.
GC_INTERVAL_S = 3600.0


class Controller:
    """One per process: the store, one supervisor per host, the alert outbox worker."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        supervise: bool = True,
        only_hosts: list[str] | None = None,
        deliver_alerts: bool | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.bus = Bus()
        self.supervise = supervise
        self.deliver_alerts = supervise if deliver_alerts is None else deliver_alerts
        self.store = Store(self.settings.database, self.bus)
        policy = self.policy = AlertPolicy.from_settings(self.settings)
        self.supervisors = Supervisors(
            self.settings, self.store, policy, supervise=supervise, only_hosts=only_hosts
        )
        self.runs = RunOps(self.settings, self.store, self.supervisors, policy)
        self.outbox = OutboxWorker(self.settings, self.store)
        self._tasks: list[asyncio.Task[None]] = []
        self.started = False

    async def start(self) -> None:
        """Open the store; with ``supervise`` start a supervisor per host and the outbox worker."""
        ensure_home(self.settings.home)
        await self.store.open()
        if self.supervise:
            await self.supervisors.start()
        if self.deliver_alerts:
            self._tasks.append(asyncio.create_task(self.outbox.run_forever(), name="outbox"))
        days = self.settings.log_retention_days
        if self.supervise and days is not None:
            self._tasks.append(asyncio.create_task(self._gc_forever(days * 86400), name="log-retention"))
        self.started = True

    async def stop(self) -> None:
        """Stop supervisors and workers, close links and the store."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await self.supervisors.stop()
        await self.store.close()
        self.bus.close()
        self.started = False

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # ------------------------------------------------------------------ hosts

    async def add_host(self, host: HostCreate) -> HostPublic:
        """Store a new host (and start supervising it when this controller supervises)."""
        await self.store.write(lambda tx: crud.insert_host(tx=tx, host=host))
        if self.supervise:
            await self.supervisors.ensure(host.name)
        return await self.get_host(host.name)

    async def list_hosts(self) -> list[HostPublic]:
        """Every host, by name."""
        return [self._with_route(h) for h in await self.store.read(queries.list_hosts)]

    async def get_host(self, name: str) -> HostPublic:
        """One host; NotFound if unknown."""
        return self._with_route(await self.store.read(queries.get_host, name))

    def _with_route(self, host: HostPublic) -> HostPublic:
        """The host with the path of this process's latest link to it (not stored: it is per process)."""
        route = self.supervisors.route_of(host.name)
        if route is None:
            return host
        return host.model_copy(update={"link_route": route[0], "link_route_reason": route[1] or None})

    async def remove_host(self, name: str) -> None:
        """Forget a host; Conflict while it has runs that are not finished."""
        await self.get_host(name)
        await self.store.write(lambda tx: crud.delete_host(tx=tx, name=name))
        await self.supervisors.drop(name)

    async def check_host(self, name: str) -> HostPublic:
        """Connect now (bootstrapping the agent if needed), refresh version and GPUs."""
        await self.get_host(name)
        await self.supervisors.check(name)
        return await self.get_host(name)

    async def host_key(self, name: str) -> str:
        """The SHA256 fingerprint the host's sshd presents (fetched without trusting it)."""
        host = await self.get_host(name)
        return await self.supervisors.fetch_fingerprint(host.ssh)

    # ------------------------------------------------------------------ runs

    async def create_run(self, spec: RunSpec) -> str:
        """Check the spec's hosts, write the run (pending), launch it through its agent; returns its id."""
        return await self.runs.create(spec)

    async def resume_run(self, run_id: str, shard: int | None = None) -> str:
        """Start a new run linked to ``run_id`` with its spec (same output directory); returns its id.

        A sharded run restarts its failed shards (or only ``shard``) and stays the same run while active."""
        return await self.runs.resume(run_id, shard)

    async def forecast(self, spec: RunSpec) -> dict[str, Any]:
        """The host's disk forecast for a spec (`extract --forecast` through the agent); launches nothing."""
        return await self.runs.forecast(spec)

    async def run_card(self, run_id: str) -> dict[str, Any]:
        """A run's dataset card (manifest.json from its host: totals, layer stats, versions, spec)."""
        return await self.runs.card(run_id)

    async def stop_run(self, run_id: str) -> RunPublic:
        """Ask the agent to stop the job; returns the run as stored afterwards."""
        await self.runs.stop(run_id)
        return await self.store.read(queries.get_run_public, run_id)

    async def list_runs(self, limit: int | None = None, offset: int = 0) -> list[RunPublic]:
        """Runs, newest first: ``limit`` of them from ``offset`` (all when None)."""
        return await self.store.read(queries.list_runs, limit, offset)

    async def count_runs(self) -> int:
        """How many runs ``list_runs`` pages through."""
        return await self.store.read(queries.count_runs)

    async def gc(self, older_than_s: float) -> dict[str, int]:
        """Drop the log lines of runs that ended more than ``older_than_s`` ago (milestones, verdicts,
        problems and specs stay), then shrink the database file; returns runs, lines, bytes before/after."""
        before = self.settings.database.stat().st_size
        done = await self.store.write(functools.partial(crud.gc_logs, before=time.time() - older_than_s))
        if done["lines"]:
            await self.store.vacuum()
        return {**done, "bytes_before": before, "bytes_after": self.settings.database.stat().st_size}

    async def _gc_forever(self, older_than_s: float) -> None:
        """The ``log_retention_days`` schedule: gc every GC_INTERVAL_S."""
        while True:
            try:
                done = await self.gc(older_than_s)
                if done["lines"]:
                    log.info("gc: dropped %d log lines of %d ended runs", done["lines"], done["runs"])
            except Exception:
                log.exception("log retention gc failed")
            await asyncio.sleep(GC_INTERVAL_S)

    async def refresh(self, hosts: Iterable[str], timeout: float = REFRESH_TIMEOUT_S) -> list[Freshness]:
        """Catch the runs of ``hosts`` up from their agents' journals now (one-shot links, in parallel)."""
        names = sorted(set(hosts))
        return list(
            await asyncio.gather(
                *(refresh_host(n, self.settings, self.store, self.policy, timeout) for n in names)
            )
        )

    async def get_run(self, run_id: str) -> RunDetail:
        """One run with spec, milestones, alerts and problems; NotFound if unknown."""
        return await self.store.read(queries.get_run_detail, run_id)

    async def read_log(
        self,
        run_id: str,
        *,
        after_offset: int = -1,
        limit: int = 1000,
        query: str | None = None,
        errors_only: bool = False,
        before_offset: int | None = None,
    ) -> list[dict[str, Any]]:
        """Stored log lines after ``after_offset`` (ascending), optionally filtered; with ``before_offset``
        the last ``limit`` matching lines before it (still ascending) — for paging backwards."""
        return await self.store.read(
            queries.read_log, run_id, after_offset, limit, query, errors_only, before_offset
        )

    # ------------------------------------------------------------------ alerts and feed

    async def list_alerts(self) -> list[AlertPublic]:
        """All alerts, newest first."""
        return await self.store.read(queries.list_alerts)

    async def ack_alert(self, alert_id: int) -> AlertPublic:
        """Mark an alert acknowledged."""
        await self.store.write(lambda tx: crud.ack_alert(tx=tx, alert_id=alert_id))
        return await self.store.read(queries.get_alert, alert_id)

    async def mute_alert(self, alert_id: int) -> AlertPublic:
        """Mute an alert: its pending delivery is dropped."""
        await self.store.write(lambda tx: crud.mute_alert(tx=tx, alert_id=alert_id))
        return await self.store.read(queries.get_alert, alert_id)

    async def feed_since(self, run_id: str | None, cursor: str | None, limit: int = 1000) -> list[BusEvent]:
        """Everything committed after ``cursor`` (all runs when ``run_id`` is None), in commit order."""
        return await self.store.read(queries.feed_since, run_id, cursor, limit)
