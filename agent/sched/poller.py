"""The daemon's one Slurm poller: one squeue call per interval answers for every submitted run at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agent import settings
from agent.sched import slurm
from agent.sched.slurmstate import JobView, combine

log = logging.getLogger("eaglewatch.agent")


Look = Callable[[str, JobView | None, str | None], None]


class SlurmPoller:
    """Tracks run → (job id, array size or task ids); calls ``on_look(run, view, error)`` after each look.

    interval_s: seconds between scheduler calls (default settings.SLURM_POLL_S: gentle on slurmctld)."""

    def __init__(self, on_look: Look, interval_s: float | None = None) -> None:
        self.on_look = on_look
        self.interval_s = settings.SLURM_POLL_S.get() if interval_s is None else interval_s
        self.jobs: dict[str, tuple[str, int | list[int] | None]] = {}
        self.calls = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def track(self, run: str, job_id: str, array: int | list[int] | None) -> None:
        """Watch ``job_id`` for ``run`` (a new submission or one re-adopted after a restart)."""
        self.jobs[run] = (job_id, array)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="slurm-poller")
        self._wake.set()

    def untrack(self, run: str) -> None:
        """Stop asking about ``run`` (it has ended)."""
        self.jobs.pop(run, None)

    def close(self) -> None:
        """Stop polling (the jobs keep running; a restarted daemon re-adopts them)."""
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            if not self.jobs:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.poll_once()
            except Exception:  # a bug here must not end polling for every run
                log.exception("slurm poll failed")
            await asyncio.sleep(self.interval_s)  # a fixed pace: at most one squeue per interval

    async def poll_once(self) -> None:
        """One squeue call for all tracked runs; sacct only for a job squeue no longer lists."""
        # Only runs tracked before squeue is asked: a job submitted while the call is under way is missing
        # from its answer, and would read as gone.
        asked = dict(self.jobs)
        try:
            rows = await asyncio.to_thread(slurm.query)
        except slurm.SlurmError as exc:
            for run in asked:
                self.on_look(run, None, str(exc))
            return
        finally:
            self.calls += 1
        for run, (job_id, array) in asked.items():
            if self.jobs.get(run) != (job_id, array):
                continue  # untracked (ended, or re-tracked) while squeue ran
            view = combine(job_id, rows, array)
            if view is None:  # past MinJobAge: only accounting, where the cluster keeps it, still knows
                view = await asyncio.to_thread(slurm.accounted, job_id)
            self.on_look(run, view, None)
