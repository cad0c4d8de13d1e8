"""The controller facade: one ``Controller`` per process (``supervise=False``: a short-lived CLI, links opened
on demand); the web and the CLI use only this.  ``ctl.bus.subscribe()`` iterates BusEvents.

BusEvent kinds and ``data``:
    "run"       RunPublic as a dict (after every state/progress change the controller commits)
    "milestone" {"seq", "kind", "at", "line", "rank", "fields", "text"}
    "check"     {"seq", "at", "file", "ok", "format", "problems": [{code, file, message}]}
    "alert"     AlertPublic as a dict
    "log"       {"offset", "next_offset", "text", "offsets"}  (a block of one run's lines, their texts joined
                by newlines: controller/logblocks.py)
    "host"      HostPublic as a dict (run_id None)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import time
import warnings
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from agent.backends import PIPELINES
from agent.spec import RunSpec
from controller import crud, queries
from controller.alerts import AlertPolicy
from controller.bus import Bus, BusEvent
from controller.errors import AgentError, Conflict, NotFound, SpecInvalid, Unreachable
from controller.fleet import REFRESH_TIMEOUT_S, Freshness, Supervisors
from controller.lifecycle import RESUMABLE_STATES, RunEvent, event_for_agent_state, is_terminal
from controller.models import AlertPublic, HostCreate, HostPublic, RunDetail, RunPublic, parse_run_spec
from controller.runs import FORECAST_TIMEOUT_S, check_hosts, new_run_id, path_refusal, scheduler_args
from controller.settings import Settings, ensure_home
from controller.shardruns import ShardOps
from controller.store import Store, Tx

log = logging.getLogger(__name__)
#: How often the ``log_retention_days`` schedule runs gc.
GC_INTERVAL_S = 3600.0
OUTBOX_POLL_S = 0.5


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
        self.sharded = ShardOps(self)
        self.outbox = OutboxWorker(self.settings, self.store)
        self._tasks: list[asyncio.Task[None]] = []

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

    # ------------------------------------------------------------------ runs

    async def _check_hosts(self, spec: RunSpec) -> None:
        """check_hosts against the spec's hosts as stored; raises SpecInvalid."""
        hosts: dict[str, dict[str, Any] | None] = {}
        for name in spec.hosts:
            try:
                hosts[name] = await self.store.read(queries.host_row, name)
            except NotFound:
                hosts[name] = None
        check_hosts(spec, hosts)

    async def create_run(self, spec: RunSpec, resumed_from: str | None = None) -> str:
        """Check the spec's hosts, write the run (pending), launch it through its agent; returns its id (a
        failed launch leaves a failed run with the reason).

        A spec with ``shards`` > 1 becomes one sharded run of several jobs (controller/shardruns.py)."""
        await self._check_hosts(spec)
        if spec.shards > 1:
            return await self.sharded.create(spec)
        run_id = new_run_id()
        document = spec.model_dump(mode="json")

        def insert(tx: Tx) -> None:
            crud.ensure_output_dir_free(tx=tx, hosts=spec.hosts, output_dir=spec.output_dir)
            crud.insert_run(
                tx=tx, run_id=run_id, name=spec.name, host=spec.hosts[0], backend=spec.backend,
                model=spec.model, spec_json=json.dumps(document), resumed_from=resumed_from,
            )  # fmt: skip
            crud.transition(tx=tx, run_id=run_id, event=RunEvent.LAUNCH, policy=self.policy)

        await self.store.write(insert)
        await self.launch(run_id, spec.hosts[0], document, discard_refused=True)
        return run_id

    async def launch(
        self,
        run_id: str,
        host: str,
        document: dict[str, Any],
        array: tuple[int, list[int]] | None = None,
        discard_refused: bool = False,
    ) -> None:
        """Ask ``host``'s agent to launch a written (starting) run with its spec as stored (``document``); a
        refusal fails it with the reason.

        ``array`` (shards, task ids): on a Slurm host, one array job running those shards of the run.
        ``discard_refused``: a host path the agent refuses (no such model, dataset or scripts; an output_dir
        not writable, in use or holding a capture) is the caller's spec error: the run is forgotten and
        SpecInvalid names the field."""
        try:
            row = await self.store.read(queries.host_row, host)
        except NotFound:
            row = {}
        extra = {"scheduler": sched} if (sched := scheduler_args(row)) else {}
        if sched is not None and array is not None:
            sched.update(shards=array[0], tasks=array[1])
        try:
            async with self.supervisors.link_for(host) as link:
                result = await link.request("launch", run=run_id, spec=document, timeout=120, **extra)
        except (AgentError, Unreachable) as exc:
            refusal = path_refusal(exc)
            if discard_refused and refusal is not None:
                await self.store.write(lambda tx: crud.discard_run(tx=tx, run_id=run_id))
                raise SpecInvalid([refusal]) from None
            reason = f"launch failed: {exc.message}"
            await self.store.write(
                lambda tx: crud.transition(
                    tx=tx, run_id=run_id, event=RunEvent.LAUNCH_FAILED, policy=self.policy, reason=reason
                )
            )
            return

        def launched(tx: Tx) -> None:
            job = result.get("job_id") if result.get("scheduler") == "slurm" else None
            crud.set_pid(tx=tx, run_id=run_id, pid=result.get("pid"), scheduler_job=job)
            # A Slurm job waits in the queue first: pending (with its job id) until the agent says running.
            event = RunEvent.LAUNCHED if job is None else RunEvent.JOB_PENDING
            crud.transition(tx=tx, run_id=run_id, event=event, policy=self.policy)

        await self.store.write(launched)
        self.supervisors.poke(host)

    async def resume_run(self, run_id: str, shard: int | None = None) -> str:
        """A new run with the same spec, linked to ``run_id``: the job keeps the files already written and
        captures only the missing or invalid ones.  Conflict unless an extraction that did not finish.

        A sharded run resumes its failed shards, or only ``shard`` (controller/shardruns.py)."""
        run = await self.store.read(queries.run_row, run_id)
        if run["shards"]:
            return await self.sharded.resume(run, shard)
        if shard is not None:
            raise Conflict(f"run {run_id} is not sharded: resume it without a shard")
        if run["state"] not in RESUMABLE_STATES:
            raise Conflict(
                f"run {run_id} is {run['state']}: only a failed, stopped or lost extraction can be resumed"
            )
        if run["backend"] == "command":
            raise Conflict(
                f"run {run_id} runs a command, which may not skip finished work: start it again instead"
            )
        spec = {**json.loads(run["spec_json"]), "resume": True}
        return await self.create_run(parse_run_spec(spec), resumed_from=run_id)

    async def forecast(self, spec: RunSpec) -> dict[str, Any]:
        """The host's forecast for a spec (bytes to write, free bytes, fits, estimated); launches nothing.

        A spec the job cannot forecast (no such model or dataset on the host) is SpecInvalid on `spec`.
        """
        await self._check_hosts(spec)
        if spec.backend == "command":
            raise SpecInvalid([{"field": "backend", "message": "a watched command has no forecast"}])
        try:
            async with self.supervisors.link_for(spec.hosts[0]) as link:
                document = spec.model_dump(mode="json")
                return await link.request("forecast", spec=document, timeout=FORECAST_TIMEOUT_S)
        except AgentError as exc:
            if (refusal := path_refusal(exc)) is not None:
                raise SpecInvalid([refusal]) from None
            if exc.agent_code in ("failed", "bad_args"):
                message = exc.message.removeprefix(f"agent: {exc.agent_code}: ")
                raise SpecInvalid([{"field": "spec", "message": f"no forecast: {message}"}]) from None
            raise

    async def run_card(self, run_id: str) -> dict[str, Any]:
        """The run's dataset card: its manifest.json as the host has it now (without the per-sample map)."""
        run = await self.store.read(queries.run_row, run_id)
        if run["backend"] == "command":
            raise Conflict(f"run {run_id} is a watched command: eaglewatch keeps no manifest for it")
        if run["backend"] in PIPELINES:
            raise Conflict(f"run {run_id} ran {run['backend']}, which writes no eaglewatch manifest")
        if run["shards"]:
            return await self.sharded.card(run)
        async with self.supervisors.link_for(run["host"]) as link:
            return await link.request("manifest", run=run_id, timeout=60)

    async def stop_run(self, run_id: str) -> RunPublic:
        """Ask the agent to stop the job; returns the run as stored afterwards."""
        await self.stop_job(run_id)
        return await self.store.read(queries.get_run_public, run_id)

    async def stop_job(self, run_id: str) -> dict[str, Any]:
        """Stop through the agent, then record the agent's status; Conflict when already finished."""
        run = await self.store.read(queries.run_row, run_id)
        if is_terminal(run["state"]):
            raise Conflict(f"run {run_id} is already {run['state']}")
        if run["shards"]:
            return await self.sharded.stop(run)
        if run["state"] == "pending" and not run.get("scheduler_job"):
            raise Conflict(f"run {run_id} is pending (not launched yet)")
        async with self.supervisors.link_for(run["host"]) as link:
            result = await link.request("stop", run=run_id, timeout=120)
            status = await link.request("status", run=run_id)
        state = status.get("state")
        if state in ("completed", "failed", "stopped", "lost"):
            ev = event_for_agent_state(str(state))
            await self.store.write(
                lambda tx: crud.transition(
                    tx=tx, run_id=run_id, event=ev, policy=self.policy, exit=status.get("exit")
                )
            )
        return result

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
        return list(await asyncio.gather(*(self.supervisors.refresh(n, timeout) for n in sorted(set(hosts)))))

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


class OutboxWorker:
    """Delivers the durable alert outbox's due rows through apprise; failures back off exponentially (with
    jitter).  Rows live in SQLite (crud.raise_alert adds them), so an alert raised while the channel or the
    controller was down is delivered later; each row is claimed first, as another process may poll too."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store

    async def run_forever(self) -> None:
        """Deliver until cancelled."""
        while True:
            try:
                await self.deliver_due()
            except Exception:
                log.exception("outbox: delivery round failed")
            await asyncio.sleep(OUTBOX_POLL_S)

    async def deliver_due(self) -> int:
        """One round: claim each due row, send it, record the outcome; returns how many were delivered."""
        now = time.time()
        delivered = 0
        for row in await self.store.read(queries.due_outbox, now):
            if not await self.store.write(functools.partial(crud.claim_outbox, outbox_id=row["id"], now=now)):
                continue
            ok, err = await self._send(row)
            if ok:
                delivered += 1
                await self.store.write(functools.partial(crud.outbox_delivered, row=row))
            else:
                backoff = min(2.0 ** (row["attempts"] + 1), self.settings.outbox_max_backoff_s)
                delay = backoff * random.uniform(0.5, 1.0)
                await self.store.write(
                    functools.partial(crud.outbox_failed, row=row, delay_s=delay, error=err)
                )
        return delivered

    async def _send(self, row: dict[str, Any]) -> tuple[bool, str | None]:
        urls = [u.get_secret_value() for u in self.settings.apprise_urls]
        if not urls:
            return False, "no apprise_urls configured"
        # apprise (heavy) is imported lazily; its plugins, loaded on the first ``add``, import stdlib modules
        # deprecated in 3.11 (imghdr): silence that here only
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import apprise

            ap = apprise.Apprise()
            for url in urls:
                ap.add(url)
        title = f"eaglewatch [{row['severity']}] {row['rule']}"
        try:
            ok = bool(await ap.async_notify(body=row["message"], title=title))
        except Exception as exc:  # apprise plugins may raise on odd input; keep the row for retry
            return False, f"{type(exc).__name__}: {exc}"
        return ok, None if ok else "apprise could not deliver to every URL"
