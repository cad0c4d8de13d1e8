"""One supervisor task per host: keep the link up (backoff + jitter), follow every unfinished run.

On connect: record reachability, agent version and GPUs; reconcile each unfinished run with the agent's
``status``; ``follow`` it from the last stored ``seq`` and log offset.  Stream messages are queued to the
store's writer in arrival order; journal events wait in an EventQueue so each write stores all that came
since the last (exactly once: see EventQueue, ingest.py and crud.py).  A dropped link marks the host
unreachable and its starting/running runs ``unknown``.  (The fleet of supervisors and the sweep: fleet.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from functools import partial
from typing import Any

from controller import alerts, crud, queries
from controller.alerts import AlertPolicy
from controller.bootstrap import open_link
from controller.errors import AgentError, HostKeyRejected, NotFound, Unreachable
from controller.lifecycle import RunEvent, event_for_agent_state
from controller.link import Link
from controller.logblocks import Block, BlockError
from controller.settings import Settings
from controller.store import Store

log = logging.getLogger(__name__)
#: Queue this many writes before the link reader waits for the writer (backpressure).
MAX_PENDING_WRITES = 2000
#: …or this many journal events wait for it (each write takes all of them, in one transaction).
MAX_PENDING_EVENTS = 5000
#: After a reconnect, runs that ended this recently are checked for undelivered events and log lines.
RECENT_S = 3600.0


class EventQueue:
    """A link's journal events (run id, event) waiting for the store's writer, taken all at once by one write.

    Only the first ``put`` after a ``take`` asks the caller to submit a write; that write, run later by the
    writer thread, takes everything queued by then, so while the writer is busy events pile up here and go
    into the database in one transaction.  No event is left behind: ``put`` appends before it looks at the
    flag and ``take`` clears the flag before it drains (deque operations and attribute reads and writes are
    atomic under the GIL).  Once ``broken`` (a batch failed to commit) it takes and keeps nothing: the caller
    reconnects and the agent replays every event after the stored last_seq.
    """

    def __init__(self) -> None:
        self._items: deque[tuple[str, dict[str, Any]]] = deque()
        self._queued = False
        self.broken = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, run_id: str, event: dict[str, Any]) -> bool:
        """Queue an event; True when the caller must submit a write that will ``take``."""
        if self.broken:
            return False
        self._items.append((run_id, event))
        if self._queued:
            return False
        self._queued = True
        return True

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        """Everything queued, oldest first (called by the write, in the writer thread)."""
        self._queued = False
        out = []
        while self._items and not self.broken:
            out.append(self._items.popleft())
        return out

    def fail(self) -> None:
        """A batch was not stored: take nothing more (the caller reconnects; the agent replays)."""
        self.broken = True
        self._items.clear()


class HostSupervisor:
    """Keeps one host's link up and its runs followed."""

    def __init__(self, name: str, settings: Settings, store: Store, policy: AlertPolicy) -> None:
        self.name = name
        self.settings = settings
        self.store = store
        self.policy = policy
        self.link: Link | None = None
        #: (route, reason) of the latest link that came up (Link.route): kept after it drops.
        self.route: tuple[str, str] | None = None
        self.connected = asyncio.Event()
        self.following: set[str] = set()
        self._events = EventQueue()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._side_tasks: set[asyncio.Future[None]] = set()

    def start(self) -> None:
        """Start the supervising task."""
        self._task = asyncio.create_task(self.run_forever(), name=f"supervisor-{self.name}")

    async def stop(self) -> None:
        """Stop supervising (a clean stop leaves run states as they are)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.link is not None:
            await self.link.close()
            self.link = None

    def poke(self) -> None:
        """Look for new runs to follow now."""
        self._wake.set()

    async def run_forever(self) -> None:
        """Connect, serve, and on failure retry with exponential backoff plus jitter."""
        delay = self.settings.reconnect_initial_s
        while True:
            try:
                host = await self.store.read(queries.host_row, self.name)
                self._events = EventQueue()  # a fresh link replays from the stored last_seq
                link, fp = await open_link(host, self.settings, self.on_stream)
                self.link = link
                delay = self.settings.reconnect_initial_s
                await self.connected_to(link, fp)
                await self._serve(link)
                reason = link.close_reason or "link closed"
            except asyncio.CancelledError:
                raise
            except NotFound:
                return  # host removed
            except HostKeyRejected as exc:
                reason = exc.message
                await self.key_rejected(exc)
                delay = max(delay, self.settings.reconnect_max_s / 2)
            except Exception as exc:
                reason = exc.message if isinstance(exc, Unreachable) else f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, Unreachable):
                    log.exception("supervisor %s: unexpected error", self.name)
            finally:
                if self.link is not None:
                    with contextlib.suppress(Exception):
                        await self.link.close()
                    self.link = None
                self.connected.clear()
                self.following.clear()
            await self.store.write(partial(crud.host_down, name=self.name, reason=reason, policy=self.policy))
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.settings.reconnect_max_s)

    async def connected_to(self, link: Link, fp: str | None) -> None:
        """Record a fresh link: reachable, agent version, fingerprint and GPUs."""
        try:
            gpus = (await link.request("gpus", timeout=30)).get("gpus", [])
        except (AgentError, Unreachable) as exc:
            log.warning("host %s: gpus failed: %s", self.name, exc)
            gpus = None
        version = link.hello.get("agent_version")
        self.route = (link.route, link.route_reason)
        await self.store.write(
            lambda tx: crud.host_up(tx=tx, name=self.name, agent_version=version, fingerprint=fp, gpus=gpus)
        )
        self.connected.set()

    async def _serve(self, link: Link) -> None:
        await self._catch_up_ended(link)
        while not link.closed.is_set():
            await self.follow_new(link)
            self._wake.clear()
            waits = [asyncio.ensure_future(link.closed.wait()), asyncio.ensure_future(self._wake.wait())]
            try:
                await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()
            await self.store.write(lambda tx: crud.host_seen(tx=tx, name=self.name))

    async def follow_new(self, link: Link) -> None:
        """Follow every unfinished run of this host not followed yet (from its stored seq and offset)."""
        for run in await self.store.read(queries.nonterminal_runs, self.name):
            if run["id"] in self.following or (run["state"] == "pending" and not run.get("scheduler_job")):
                continue  # pending without a Slurm job id: not launched yet
            # A run still 'starting' is being launched by some controller; follow it once launched
            # (or, if that controller died mid-launch, after a grace period).
            if run["state"] != "starting" or time.time() - run["created_at"] > 30:
                await self._follow(link, run)

    async def catch_up_once(self, link: Link) -> None:
        """What a fresh link does first: recently ended runs' leftovers, then every unfinished run."""
        await self._catch_up_ended(link)
        await self.follow_new(link)

    async def _catch_up_ended(self, link: Link) -> None:
        """Runs that ended recently may have journal events or log lines the last link did not deliver."""
        since = time.time() - RECENT_S
        for run in await self.store.read(queries.recently_ended_runs, self.name, since):
            try:
                status = await link.request("status", run=run["id"])
            except AgentError:
                continue
            if (
                int(status.get("last_seq") or 0) > run["last_seq"]
                or int(status.get("log_size") or 0) > run["log_offset"]
            ):
                self.following.add(run["id"])
                with contextlib.suppress(AgentError):
                    await link.request(
                        "follow", run=run["id"], after_seq=run["last_seq"], log_offset=run["log_offset"]
                    )

    async def _follow(self, link: Link, run: dict[str, Any]) -> None:
        run_id = run["id"]
        try:
            status = await link.request("status", run=run_id)
        except AgentError as exc:
            if exc.agent_code == "not_found" and (run["state"] != "pending" or run.get("scheduler_job")):
                # Never launched (a controller died mid-launch) or forgotten by the host: it cannot run.
                event = RunEvent.LAUNCH_FAILED if run["state"] == "starting" else RunEvent.JOB_LOST
                reason = (
                    "launch was interrupted: the agent never received it"
                    if event is RunEvent.LAUNCH_FAILED
                    else "the agent has no record of this job"
                )
                await self.store.write(
                    partial(crud.transition, run_id=run_id, event=event, reason=reason, policy=self.policy)
                )
                return
            log.warning("run %s: status failed: %s", run_id, exc)
            return
        self.following.add(run_id)
        try:
            await link.request("follow", run=run_id, after_seq=run["last_seq"], log_offset=run["log_offset"])
        except AgentError as exc:
            # Stays in `following` so this does not repeat every second; the next connection retries.
            log.warning("run %s: follow failed: %s", run_id, exc)
            return
        if status.get("state") in ("running", "pending") and run["state"] in ("unknown", "starting"):
            now = event_for_agent_state(str(status["state"]))  # pending: a Slurm job back in its queue
            await self.store.write(partial(crud.transition, run_id=run_id, event=now, policy=self.policy))
        elif status.get("state") == "lost" and run["state"] in ("unknown", "running", "starting", "pending"):
            # A lost job never writes a final journal state of its own.
            await self.store.write(
                partial(
                    crud.transition,
                    run_id=run_id,
                    event=RunEvent.JOB_LOST,
                    policy=self.policy,
                    exit=status.get("exit"),
                    reason="the agent lost the job",
                )
            )

    async def on_stream(self, msg: dict[str, Any]) -> None:
        """Queue a stream message (journal event or log block) to the store, in arrival order."""
        mtype, run_id = msg.get("type"), msg.get("run")
        if not isinstance(run_id, str):
            return
        if mtype == "event" and isinstance(msg.get("event"), dict):
            queue = self._events
            if queue.put(run_id, msg["event"]):
                # committed on this thread while the writer is idle (two thread hand-offs fewer on a
                # milestone's way to the page), and without the log blocks' wait for company
                fut = self.store.submit(
                    lambda tx: crud.apply_event_batch(tx=tx, events=queue.take(), policy=self.policy),
                    now_if_idle=True,
                    at_once=True,
                )
                fut.add_done_callback(lambda f: self._after_events(queue, f))
        elif mtype == "log_block":
            try:
                block = Block.from_message(msg)
            except BlockError as exc:
                log.warning("host %s, run %s: %s", self.name, run_id, exc)
                return
            fut = self.store.submit(
                lambda tx: crud.add_log_block(tx=tx, run_id=run_id, block=block), now_if_idle=True
            )
            fut.add_done_callback(_log_failure)
        if self.store.pending > MAX_PENDING_WRITES or len(self._events) > MAX_PENDING_EVENTS:
            await self.store.submit(lambda tx: None)  # backpressure: wait for the writer to catch up

    def _after_events(self, queue: EventQueue, fut: asyncio.Future[int]) -> None:
        if fut.cancelled() or fut.exception() is None:
            return
        _log_failure(fut)
        # The batch is not stored and last_seq did not move: drop this link's queued events and reconnect;
        # the agent replays everything after the stored last_seq (applying later events now would skip it).
        queue.fail()
        if self.link is not None:
            task = asyncio.ensure_future(self.link.close())
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)

    async def key_rejected(self, exc: HostKeyRejected) -> None:
        """Raise the host_key_changed alert: the host presented a key known_hosts does not trust."""
        draft = alerts.host_key_changed(self.name, exc.message)
        await self.store.write(lambda tx: crud.raise_alert(tx=tx, draft=draft, policy=self.policy))


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("store write from link failed: %s", fut.exception())
