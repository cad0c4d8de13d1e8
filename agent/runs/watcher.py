"""Per-run watcher: log tail → LineSplitter → MilestoneEngine → journal, output checks, final state.

An active run's watcher owns ``ingest`` (log_ingest.py), ``outbox`` (outbox.py: each event once across a
SIGKILL, the cursor after the fsync) and ``checks`` (capture_checks.py); its loop decides when each runs.  A
run that had ended before this daemon started gets none of them: it only answers status and follow.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from agent.jobs import attached, procfs
from agent.jobs import control as jobs
from agent.logs.generations import LogChain
from agent.logs.linebuffer import LineBuffer
from agent.logs.tail import POLL_INTERVAL_S, Broadcast, Pulse
from agent.paths import RunPaths, read_json
from agent.runs.capture_checks import OutputChecks
from agent.runs.jobspec import JobSpec
from agent.runs.journal import Journal, scan
from agent.runs.log_ingest import READ_CHUNK, LogIngest, restore_engine
from agent.runs.outbox import Outbox
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
# While catching up on a backlog: let the other runs and clients in this often (not after every read), and
# start a journal fsync (in a worker thread) then.
COMMIT_EVERY_S = 0.05


class RunWatcher:
    """Everything the daemon knows about one run, and the task that watches it while it is active."""

    # The parts that watch an active run (see the module docstring); an ended run has none.
    ingest: LogIngest
    outbox: Outbox
    checks: OutputChecks

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
        journaled = scan(journal.path)
        self.summary = RunSummary.from_events(journaled)
        saved = read_json(paths.cursor)
        saved = saved if isinstance(saved, dict) else {}
        self.chain = LogChain.restore(paths.log, saved.get("log"), self._job_pid)
        self.task: asyncio.Task[None] | None = None
        self._stop_requested = False
        if self.summary.terminal is None:
            self._build(saved, journaled)
        else:  # an ended run only answers status and follow: no engine, no open file
            journal.close()

    def _build(self, saved: dict[str, Any], journaled: list[dict[str, Any]]) -> None:
        """The parts that watch the run, resuming from the cursor ``saved`` past the events ``journaled``."""
        self.outbox = Outbox(
            self.journal,
            self.summary,
            self.events_changed,
            self.paths.cursor,
            lambda: {**self.ingest.position(), "checked": self.checks.checked, "held": self._held},
        )
        # Events journaled after the cursor was saved will be regenerated: the outbox skips them once.
        recovered = self.outbox.skip_journaled(journaled, int(saved.get("seq", 0)))
        job = read_json(self.paths.job)
        # a Slurm array job's task logs are merged into output.log
        array = job.get("array") if isinstance(job, dict) and job.get("scheduler") == "slurm" else None
        self.ingest = LogIngest(
            self.chain,
            self.lines,
            restore_engine(self.spec, saved.get("engine"), self.paths.run),
            int(saved.get("offset", 0)),
            int(saved.get("line", 0)),
            LogMerger(self.paths, array) if isinstance(array, int) and array else None,
            self._milestones,
        )
        self.checks = OutputChecks(
            self.spec,
            dict(saved.get("checked", {})),
            recovered,
            self.outbox.add,
            lambda: self.ingest.line,
            self._shape_failed,
            self._checks_advanced,
        )
        self._last_data = self._dirty_since = self._active = time.monotonic()
        self._flushed = True
        self._checks_came = False  # results from the check children are queued: save the cursor
        # The scheduler's task_ended events once the job is over, kept in the cursor: sched.json already
        # marks them seen, so a daemon killed before the final state would otherwise never send them.
        self._held: list[dict[str, Any]] = list(saved.get("held") or [])

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

    # --- what the parts report ---------------------------------------------------------------------
    def _milestones(self, events: list[dict[str, Any]]) -> None:
        """Milestones from the log go to the journal; the job's own failed shape check may stop it."""
        self.outbox.add(events)
        for ev in events:
            if ev["kind"] == "shape_check_failed":  # the job's own check said so in its log
                self._shape_failed(f"shape check failed: {ev['fields'].get('code') or ev['text'][:160]}")

    def _shape_failed(self, reason: str) -> None:
        """on_shape_failure = stop is decided here only, once; the controller records what follows."""
        if self.spec.on_shape_failure == "stop" and not self._stop_requested:
            self._stop_requested = True
            self.stopper(self.paths.run, reason)

    def _checks_advanced(self) -> None:
        self._checks_came = True
        self.pulse.notify()

    def note(self, events: list[dict[str, Any]]) -> None:
        """Journal events from outside the log (the scheduler's word on the job) and look again soon."""
        if self.summary.terminal is not None:
            return
        held: list[dict[str, Any]] = []
        if self.paths.exit.exists():
            # The job is over: its tasks' ends go out with the final state, after the merge and every
            # check, so that no shard (nor the sharded run) looks ended while its files are being checked.
            held = [e for e in events if e.get("kind") == "task_ended"]
            events = [e for e in events if e.get("kind") != "task_ended"]
            self._held += held
        self.outbox.add(events)
        self.outbox.commit()
        if held:
            self.outbox.save(force=True)
        self.wake()

    # --- the loop --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start watching (a no-op for a run already in a terminal state)."""
        if self.summary.terminal is None and self.task is None:
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
                elif self.checks.waiting:
                    timeout = OUTPUT_SCAN_S
                await self.pulse.wait(timeout)
        finally:
            await self.checks.close()
            with contextlib.suppress(OSError):
                self.outbox.save(force=True)

    async def _step(self) -> bool:
        """One look at the run; True once its final state is journaled.  A bug here must not end watching."""
        try:
            return await self._look()
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception:
            log.exception("watching run %s failed; retrying in 1 s", self.paths.run)
            await asyncio.sleep(1.0)
            return False

    async def _look(self) -> bool:
        got_data = await self._pump()
        now = time.monotonic()
        if got_data:
            self._active = now
            if self._flushed:
                self._dirty_since = now
            self._last_data, self._flushed = now, False
        if not self._flushed and (
            now - self._last_data >= IDLE_FLUSH_S or now - self._dirty_since >= MAX_HOLD_S
        ):
            # With a known TP world, rank groups stay open until it is full or the log has been quiet for
            # GROUP_HOLD_S.
            released = self.ingest.release(quiet=now - self._last_data >= GROUP_HOLD_S)
            self._flushed = not self.ingest.holding
            if released or self._flushed:
                self.outbox.save(force=True)
        if now - self._last_scan >= OUTPUT_SCAN_S:
            self._last_scan = now
            if await self.checks.scan(final=False):
                self._active = now
                self.outbox.save(force=True)
        if self._checks_came:  # followers see the results at once; the disk syncs them behind
            self._checks_came = False
            self.outbox.sync_behind()
        if self.paths.exit.exists():
            await self._finish()
            return True
        if now - self._last_live >= LIVENESS_S:
            self._last_live = now
            if self.spec.attach is not None and self.spec.attach.slurm_job is None:
                await self._look_attached(now)
            elif jobs.classify(self.paths) == "lost":
                # Look again shortly: the job may have just ended with exit.json not yet renamed in place.
                await asyncio.sleep(0.5)
                if jobs.classify(self.paths) == "lost":
                    await self._finish(lost=True)
                    return True
        return False

    async def _look_attached(self, now: float) -> None:
        """An attached job without a Slurm job id (that one is the poller's): its pid tree, then the idle
        timeout (agent/jobs/attached.py); either writes exit.json, which the next look finishes on."""
        if await asyncio.to_thread(attached.look, self.paths):
            self.pulse.notify()
            return
        idle = self.spec.attach.idle_timeout_s if self.spec.attach else None
        if idle is not None and now - self._active >= idle:
            attached.end(self.paths, attached.IDLE)
            self.pulse.notify()

    async def _pump(self) -> bool:
        """Feed what the log gained to the splitter and the rules, journal their events; True when bytes
        were read."""
        await self.ingest.merge()
        got = False
        started = time.monotonic()
        while True:
            n, seam = self.ingest.read()
            if seam:
                self.outbox.save(force=True)
                self.log_changed.notify()
                got = True
                continue
            if not n:
                break
            got = True
            # The lines' milestones are written now (fsynced later, in a worker thread), and followers are
            # told after the events: a live milestone goes out ahead of its own line, so on the way to the
            # page it does not queue behind that line's commit, SSE message and render.
            self.outbox.commit(sync=False)
            self.log_changed.notify()
            if n < READ_CHUNK:  # caught up
                break
            now = time.monotonic()
            if now - started >= COMMIT_EVERY_S:
                # A long backlog must not starve the other runs and clients: let them in, and have the
                # journal synced meanwhile (an fsync is a wait, not work: it never holds this loop up).
                started = now
                self.outbox.sync_behind()
                await asyncio.sleep(0)
        if got:
            # Followers send the new events while the disk syncs them (an fsync can take tens of ms), and
            # the cursor is written only after it.
            self.outbox.sync_behind()
        return got

    # --- the end ---------------------------------------------------------------------------------
    async def _warn_leftovers(self) -> None:
        """Journal a warning when processes of the run outlive the job (vLLM workers keep GPU memory)."""
        job = read_json(self.paths.job)
        born = job.get("start_time") if isinstance(job, dict) and not job.get("scheduler") else None
        # Only what the job started can carry its run id: older processes are not read (an end of run
        # would otherwise scan every process's environment).
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
        self.outbox.add(
            [milestone_event("warning", self.ingest.line, text, rule="leftover_processes", processes=procs)]
        )

    async def _finish(self, lost: bool = False) -> None:
        """Process the rest of the log, check the last files, journal the final state once."""
        await self.ingest.merge(final=True)
        await self._pump()
        self.ingest.finish()
        self._flushed = True
        self.log_changed.notify()
        self._stop_requested = True  # the job has ended: nothing left to stop
        await self.checks.scan(final=True)
        await self.checks.drain()  # the verdict waits for every file's check
        await self.checks.check_index_gaps()
        await self.checks.close()
        self.outbox.add(self._held)
        self.outbox.commit(sync=False)
        if self.summary.terminal is None:
            if not self.paths.stop.exists() and self.spec.attach is None:  # a stop reports its own leftovers
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
                self.outbox.add([milestone_event("failed", self.ingest.line, reason, reason=reason)])
            ev: dict[str, Any] = {"type": "state", "state": state, "reason": reason}
            if isinstance(exit_rec, dict):
                ev["exit"] = {"code": exit_rec.get("code"), "signal": exit_rec.get("signal")}
            self.outbox.add([ev])
        # Followers get the final state now, while the disk syncs it (in a worker thread, like the rest of
        # the journal); the last cursor follows the fsync.
        self.outbox.commit(sync=False)
        await self.outbox.synced()
        if self.journal.unsynced:
            await asyncio.to_thread(self.journal.sync)
        self.outbox.save(force=True)
        self.journal.close()
        self.chain.close(keep_unnamed=True)  # streams reopen the named file; a renamed one is kept open
        self.log_changed.notify()  # log followers flush the job's unterminated last line now
