"""Per-run watcher: log tail → LineSplitter → MilestoneEngine → journal, output checks, final state.

Exactly-once across a daemon SIGKILL: the cursor (log offset = splitter.pending_offset, line number, engine
snapshot, journal seq) is written after the journal append is fsynced.  A restarted watcher resumes from
the cursor; events it regenerates that the journal already holds past the cursor's seq are recognised
and skipped, so no line is lost and no milestone or seq is written twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from agent.jobs import control as jobs
from agent.jobs import procfs
from agent.logs.generations import LogChain
from agent.logs.linebuffer import LineBuffer
from agent.logs.splitter import LineSplitter
from agent.logs.tail import POLL_INTERVAL_S, Broadcast, Pulse
from agent.milestones.engine import Milestone, MilestoneEngine, RuleError, load_rules
from agent.paths import RunPaths, read_json
from agent.runs.capture_checks import OutputChecks
from agent.runs.child_rules import ChildRules
from agent.runs.classifier import ClassifierError, RemoteEngine
from agent.runs.cursor import CursorKeeper
from agent.runs.jobspec import JobSpec
from agent.runs.journal import Journal, scan
from agent.runs.log_ingest import LogIngest
from agent.runs.summary import RunSummary, final_state, milestone_event
from agent.sched.logmerge import LogMerger

log = logging.getLogger("eaglewatch.agent")
IDLE_FLUSH_S = 1.0
# A job that never goes quiet (progress lines every 0.5 s) must not hold its milestones until the group
# window of lines passes: release whatever the engine holds after this long, idle or not.
MAX_HOLD_S = 3.0
# How long a rank group (one line every TP rank prints) waits for its other ranks in a quiet log.
GROUP_HOLD_S = 15.0
OUTPUT_SCAN_S = 2.0
LIVENESS_S = 5.0  # a safety net: inotify reports exit.json the moment it appears


def _milestone_key(ev: dict[str, Any]) -> tuple[Any, ...]:
    return (ev.get("kind"), ev.get("line"), ev.get("rank"), ev.get("text"))


class RunWatcher(ChildRules, CursorKeeper, OutputChecks, LogIngest):
    """Everything the daemon knows about one run, and the task that watches it while it is active."""

    def __init__(
        self,
        paths: RunPaths,
        journal: Journal,
        spec: JobSpec,
        stopper: Callable[[str, str], None],
        polling: bool,
    ) -> None:
        self.paths = paths
        self.journal = journal
        self.spec = spec
        self.stopper = stopper
        self.polling = polling
        self.events_changed = Broadcast()
        self.log_changed = Broadcast()
        self.lines = LineBuffer()  # what followers stream: the log is read and split here only
        self.pulse = Pulse()
        # Every batch written wakes the followers and goes into the summary, also those the journal's
        # encoder stage held.
        journal.subscribe_batches(self._written)
        self.summary = RunSummary.from_events(scan(journal.path))
        saved = read_json(paths.cursor)
        self.chain = LogChain.restore(
            paths.log, saved.get("log") if isinstance(saved, dict) else None, self._job_pid
        )
        self.task: asyncio.Task[None] | None = None
        self._skip: Counter[tuple[Any, ...]] = Counter()
        self._outbox: list[dict[str, Any]] = []
        self._recovered_checks: set[str] = set()
        if self.summary.terminal is None:
            self._restore_cursor()
        else:  # an ended run only answers status and follow: no engine, no open file
            journal.close()
        self._last_data = self._dirty_since = time.monotonic()
        self._flushed = True
        self._cursor_at = 0.0
        self._cursor_version = 0  # bumped by every cursor write
        self._syncing = None
        self._pending_files: dict[str, tuple[int, int]] = {}
        self._checking = False
        self._stop_requested = False
        #: an array job's task logs, merged into output.log (set by the daemon before start)
        self.merger: LogMerger | None = None
        self._shard_lines: dict[int, int] = {}  # line number → shard of a merged line, for its milestones
        self._in_daemon = False  # rules stay in the daemon's process (a classifier child failed)

    # --- state -----------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``running`` until a terminal state is journaled (``pending`` while a Slurm job is queued)."""
        if self.summary.terminal is not None:
            return self.summary.terminal
        sched = read_json(self.paths.sched) if self.paths.sched.exists() else None
        if isinstance(sched, dict) and sched.get("phase") in ("submitted", "pending"):
            return "pending"
        return "running"

    def status(self) -> dict[str, Any]:
        """The ``status`` reply of this run."""
        job = read_json(self.paths.job)
        job = job if isinstance(job, dict) else {}
        exit_rec = read_json(self.paths.exit)
        size = self.chain.end_offset()  # a stream offset: it keeps growing across truncation and rotation
        return {
            "run": self.paths.run,
            "state": self.state,
            "pid": job.get("pid"),
            "start_time": job.get("start_time"),
            "exit": {"code": exit_rec.get("code"), "signal": exit_rec.get("signal")}
            if isinstance(exit_rec, dict)
            else None,
            "last_seq": self.journal.last_seq,
            "log_size": size,
            "reason": self.summary.reason,
            "name": self.spec.name,
            "backend": self.spec.backend,
            "scheduler": read_json(self.paths.sched) if job.get("scheduler") else None,
        }

    def _job_pid(self) -> int | None:
        """The job's pid while it may still hold the log open (to reach a log renamed away)."""
        if self.paths.exit.exists():
            return None
        job = read_json(self.paths.job)
        pid = job.get("pid") if isinstance(job, dict) else None
        return pid if isinstance(pid, int) and not isinstance(pid, bool) else None

    def _restore_cursor(self) -> None:
        try:
            self._rules = load_rules(extra=self.spec.rules, backend=self.spec.backend)
        except (RuleError, TypeError):  # checked at launch; a spec edited on disk falls back to built-ins
            self._rules = load_rules(backend=self.spec.backend)
        cur = read_json(self.paths.cursor)
        cur = cur if isinstance(cur, dict) else {}
        self.offset = int(cur.get("offset", 0))
        self.line = int(cur.get("line", 0))
        self.checked: dict[str, list[int]] = dict(cur.get("checked", {}))
        snap = cur.get("engine")
        world = self.spec.world_size
        try:
            self.engine: MilestoneEngine | RemoteEngine = (
                MilestoneEngine.restore(self._rules, snap) if snap else MilestoneEngine(self._rules, world)
            )
        except Exception:  # e.g. a snapshot from another agent version: lose an open group, not the run
            log.warning("run %s: engine snapshot not restorable; starting a fresh engine", self.paths.run)
            self.engine = MilestoneEngine(self._rules, world)
        self.splitter = LineSplitter(start_offset=self.offset)
        self.fed = self.offset
        self.lines.reset(self.offset)
        # Events journaled after the cursor was saved will be regenerated: remember them to skip them once.
        for ev in scan(self.journal.path):
            if int(ev.get("seq", 0)) <= int(cur.get("seq", 0)):
                continue
            if ev.get("type") == "milestone":
                self._skip[_milestone_key(ev)] += 1
            elif ev.get("type") == "check":
                self._recovered_checks.add(str(ev.get("file")))

    # --- journaling ------------------------------------------------------------------------------
    def _journal_milestones(self, milestones: list[Milestone]) -> None:
        for m in milestones:
            ev = {"type": "milestone", **m.to_dict()}
            if self._shard_lines and m.line in self._shard_lines:
                ev["fields"] = {**ev["fields"], "shard": self._shard_lines[m.line]}
            if self._skip and _milestone_key(ev) in self._skip:  # journaled before a crash
                self._append(ev)
            else:
                self._outbox.append(ev)
            if m.kind == "shape_check_failed":  # the job's own check said so in its log
                self._shape_failed(f"shape check failed: {m.fields.get('code') or m.text[:160]}")

    def _append(self, ev: dict[str, Any]) -> None:
        """Queue an event for the journal unless it is one already journaled before a crash."""
        if ev.get("type") == "milestone":
            key = _milestone_key(ev)
            if self._skip[key] > 0:
                self._skip[key] -= 1
                if not self._skip[key]:
                    del self._skip[key]  # _journal_milestones looks keys up with ``in``
                self.summary.observe(ev)
                return
        self._outbox.append(ev)

    def _written(self, events: list[dict[str, Any]]) -> None:
        observe = self.summary.observe
        for ev in events:
            observe(ev)
        self.events_changed.notify()

    def _commit(self, sync: bool = True) -> None:
        """Write the queued events and those in the journal's encoder stage (one fsync, unless ``sync`` is
        False); the journal's listener takes them into the summary."""
        if self._outbox:
            events, self._outbox = self._outbox, []
            self.journal.append_many(events, sync=sync)
        else:
            self.journal.drain()  # the cursor is saved after a commit: it must not point past the file
        if sync:
            self.journal.sync()

    def _submit(self) -> None:
        """Hand the queued events to the journal's encoder stage: numbered now, written by a later submit
        or commit, while the watcher reads and classifies on."""
        if self._outbox:
            events, self._outbox = self._outbox, []
            self.journal.submit(events)

    def note(self, events: list[dict[str, Any]]) -> None:
        """Journal events from outside the log (the scheduler's word on the job) and look again soon."""
        if self.summary.terminal is not None:
            return
        for ev in events:
            self._append(ev)
        self._commit()
        self.wake()

    # --- the loop --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start watching (a no-op for a run already in a terminal state)."""
        if self.summary.terminal is None and self.task is None:
            self.journal.start_stage()
            self._go_remote()
            self.task = asyncio.get_running_loop().create_task(self._run(), name=f"watch-{self.paths.run}")

    def wake(self) -> None:
        """Something changed in the run dir (inotify)."""
        self.pulse.notify()
        if self.task is None or self.task.done():
            # No watcher reads the log: followers read it themselves.  While one does, its pump tells them
            # after the new lines' milestones are journaled, so a milestone never waits behind its own line.
            self.log_changed.notify()

    async def _run(self) -> None:
        self._last_scan = self._last_live = 0.0
        try:
            while not await self._step():
                timeout = LIVENESS_S
                if self.polling:
                    timeout = POLL_INTERVAL_S
                elif not self._flushed:
                    timeout = IDLE_FLUSH_S
                elif self._pending_files:
                    timeout = OUTPUT_SCAN_S
                await self.pulse.wait(timeout)
        finally:
            with contextlib.suppress(OSError, ClassifierError):
                self._save_cursor(force=True)
            self._close_child()

    async def _step(self) -> bool:
        """One look at the run; True once its final state is journaled.  A bug here must not end watching."""
        try:
            return await self._look()
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except ClassifierError as exc:
            log.warning("run %s: %s; classifying in the daemon from the cursor", self.paths.run, exc)
            self._child_failed()
            return False
        except Exception:
            log.exception("watching run %s failed; retrying in 1 s", self.paths.run)
            await asyncio.sleep(1.0)
            return False

    async def _look(self) -> bool:
        got_data = await self._pump()
        now = time.monotonic()
        if got_data:
            if self._flushed:
                self._dirty_since = now
            self._last_data, self._flushed = now, False
        if not self._flushed and (
            now - self._last_data >= IDLE_FLUSH_S or now - self._dirty_since >= MAX_HOLD_S
        ):
            # With a known TP world, rank groups stay open until it is full or the log has been quiet for
            # GROUP_HOLD_S; with an unknown one nothing says more ranks will come.
            quiet = now - self._last_data >= GROUP_HOLD_S or self.engine.world_size is None
            released = self.engine.flush() if quiet else self.engine.release_ready()
            self._journal_milestones(released)
            self._flushed = self.engine.open_groups == 0
            if released or self._flushed:
                self._save_cursor(force=True)
        if now - self._last_scan >= OUTPUT_SCAN_S:
            self._last_scan = now
            await self._scan_outputs(final=False)
        if self.paths.exit.exists():
            await self._finish()
            return True
        if now - self._last_live >= LIVENESS_S:
            self._last_live = now
            if jobs.classify(self.paths).status == "lost":
                # Look again shortly: the job may have just ended with exit.json not yet renamed in place.
                await asyncio.sleep(0.5)
                if jobs.classify(self.paths).status == "lost":
                    await self._finish(lost=True)
                    return True
        return False

    # --- outputs (capture_checks.py) ----------------------------------------------------------------
    def _shape_failed(self, reason: str) -> None:
        """on_shape_failure = stop is decided here only, once; the controller records what follows."""
        if self.spec.on_shape_failure == "stop" and not self._stop_requested:
            self._stop_requested = True
            self.stopper(self.paths.run, reason)

    # --- the end ---------------------------------------------------------------------------------
    async def _warn_leftovers(self) -> None:
        """Journal a warning when processes of the run outlive the job (vLLM workers keep GPU memory)."""
        job = read_json(self.paths.job)
        born = job.get("start_time") if isinstance(job, dict) and not job.get("scheduler") else None
        # Only what the job started can carry its run id: older processes are not read (an end of run
        # scanned every process's environment, ~40 ms on a 16-core host).
        born = born if isinstance(born, int) and not isinstance(born, bool) else None
        scan_run = functools.partial(jobs.run_processes, self.paths.run, None, {os.getpid()}, born)
        left = await asyncio.to_thread(scan_run)
        if left:
            await asyncio.sleep(1.0)  # ones that were already exiting are gone by now
            left = await asyncio.to_thread(scan_run)
        if not left:
            return
        procs = [{"pid": pid, "cmdline": procfs.cmdline(pid)} for pid in left]
        text = f"{len(left)} process(es) of the run outlived the job: pids {', '.join(map(str, left))}"
        self._append(milestone_event("warning", self.line, text, rule="leftover_processes", processes=procs))

    async def _finish(self, lost: bool = False) -> None:
        """Process the rest of the log, check the last files, journal the final state once."""
        if self.merger is not None:
            await asyncio.to_thread(self.merger.pump, True)
        await self._pump()
        self._feed_lines(self.splitter.flush(), self.splitter.pending_offset)
        self._journal_milestones(self.engine.flush())
        self._flushed = True
        self.log_changed.notify()
        self._stop_requested = True  # the job has ended: nothing left to stop
        await self._scan_outputs(final=True)
        await self._check_index_gaps()
        self._commit(sync=False)
        if self.summary.terminal is None:
            if not self.paths.stop.exists():  # a stop reports its own leftovers
                await self._warn_leftovers()
            stop_rec = read_json(self.paths.stop)
            exit_rec = None if lost else read_json(self.paths.exit)
            state, reason = final_state(
                exit_rec if isinstance(exit_rec, dict) else None,
                stop_rec if isinstance(stop_rec, dict) else None,
                self.summary,
                self.spec.backend,
            )
            if state == "failed" and not self.summary.failed_seen:
                self._append(milestone_event("failed", self.line, reason, reason=reason))
            ev: dict[str, Any] = {"type": "state", "state": state, "reason": reason}
            if isinstance(exit_rec, dict):
                ev["exit"] = {"code": exit_rec.get("code"), "signal": exit_rec.get("signal")}
            self._append(ev)
        # Followers get the final state now, while the disk syncs it (in a worker thread, like the rest of
        # the journal); the last cursor follows the fsync.
        self._commit(sync=False)
        await self._synced()
        if self.journal.unsynced:
            await asyncio.to_thread(self.journal.sync)
        self._save_cursor(force=True)
        self._close_child()
        self.journal.close()
        self.chain.close(keep_unnamed=True)  # streams reopen the named file; a renamed one is kept open
        self.log_changed.notify()  # log followers flush the job's unterminated last line now
