"""The daemon's Slurm poller looks only at runs tracked before squeue was asked.

squeue is a stand-in here: the race needs a job submitted while one squeue call is under way, which the real
cluster (tests/slurm) cannot be made to hold open; the stand-in blocks until the test has tracked the job."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agent.sched import jobs as poller_mod
from agent.sched.jobs import SlurmPoller
from agent.sched.slurmstate import JobView, TaskRow


def _row(job_id: str) -> TaskRow:
    return TaskRow(job_id, None, "RUNNING", "None", None, 1, "debug")


async def test_a_job_submitted_during_a_squeue_call_is_not_taken_for_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def query() -> list[TaskRow]:
        calls.append(1)
        if len(calls) == 1:  # the first call was asked before job 2 was submitted: it does not list it
            asked.set()
            release.wait(10)
            return [_row("1")]
        return [_row("1"), _row("2")]

    monkeypatch.setattr(poller_mod.slurm, "query", query)
    monkeypatch.setattr(poller_mod.slurm, "accounted", lambda job_id: None)  # no accounting: gone is lost
    looks: list[tuple[str, JobView | None, str | None]] = []
    seen = asyncio.Event()

    def on_look(run: str, view: JobView | None, error: str | None) -> None:
        looks.append((run, view, error))
        if run == "new":
            seen.set()

    poller = SlurmPoller(on_look, interval_s=0.01)
    try:
        poller.track("old", "1", None)
        await asyncio.to_thread(asked.wait, 10)
        poller.track("new", "2", None)  # sbatch returned while squeue was still answering
        release.set()
        await asyncio.wait_for(seen.wait(), 10)
    finally:
        poller.close()
    assert looks[0][0] == "old" and looks[0][1] is not None
    new = [(view, error) for run, view, error in looks if run == "new"]
    assert new[0][0] is not None and new[0][0].phase == "running", new
