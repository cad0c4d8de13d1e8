"""Pure: a cluster's share of a sharded run as one array job (task ids picked) and each task's own end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.paths import RunPaths
from agent.sched.jobs import advance, disjoint_shards, live_claim, shard_claim, task_outcome
from agent.sched.options import SlurmOptions
from agent.sched.slurm import sbatch_argv
from agent.sched.slurmstate import combine, parse_squeue, task_ids
from agent.spec import parse_spec
from controller.sharding import array_spec, job_document, task_state
from controller.shardruns import shard_jobs, slurm_arrays

BASE = {"kind": "slurm", "partition": "debug"}


def test_options_take_task_ids_of_the_shards_and_sbatch_submits_only_those(tmp_path: Path) -> None:
    opts = SlurmOptions.parse({**BASE, "shards": 4, "tasks": [2, 0]})
    assert opts.task_ids() == [0, 2]
    argv = sbatch_argv(RunPaths(run="r", dir=tmp_path), opts, None, None)
    assert "--array=0,2" in argv and str(tmp_path / "output.task-%a.log") in " ".join(argv)
    every = sbatch_argv(
        RunPaths(run="r", dir=tmp_path), SlurmOptions.parse({**BASE, "shards": 2}), None, None
    )
    assert "--array=0-1" in every
    for bad in ({"tasks": [0]}, {"shards": 2, "tasks": [2]}, {"shards": 2, "tasks": [1, 1]},
                {"shards": 2, "tasks": []}, {"shards": 2, "tasks": ["0"]}):  # fmt: skip
        with pytest.raises(ValueError, match=r"scheduler\.tasks"):
            SlurmOptions.parse({**BASE, **bad})


def test_an_array_of_picked_tasks_ends_once_those_have() -> None:
    one = parse_squeue("5|0|6|COMPLETED|None|0|1|debug|\n")
    running = combine("5", one, [0, 2])
    assert running is not None and running.phase == "running"  # task 2 not seen to end yet
    both = parse_squeue("5|0|6|COMPLETED|None|0|1|debug|\n5|2|7|COMPLETED|None|0|1|debug|\n")
    view = combine("5", both, [0, 2])
    assert view is not None and (view.phase, view.outcome) == ("ended", "completed")


def test_each_task_that_ends_gets_one_task_ended_milestone_with_its_outcome() -> None:
    rec = {"job_id": "5", "array": 2, "phase": "running", "tasks": {"0": "RUNNING", "1": "RUNNING"}}
    look = combine("5", parse_squeue("5|0|6|RUNNING|None|0|1|d|\n5|1|7|CANCELLED|None|0|1|d|\n"), 2)
    rec, events, ended = advance(rec, look, None, 4, 1.0)
    assert ended is None
    (ev,) = [e for e in events if e["kind"] == "task_ended"]
    assert ev["fields"]["shard"] == 1 and ev["fields"]["outcome"] == "failed"  # cancelled, no stop asked
    assert ev["fields"]["reason"].startswith("CANCELLED")
    look = combine("5", parse_squeue("5|0|6|TIMEOUT|None|15|1|d|\n5|1|7|CANCELLED|None|0|1|d|\n"), 2)
    rec, events, ended = advance(rec, look, None, 5, 2.0)
    assert [(e["fields"]["shard"], e["fields"]["outcome"]) for e in events if e["kind"] == "task_ended"] == [
        (0, "failed")
    ]  # task 1 said once
    assert ended is not None and ended["scheduler_state"] == "TIMEOUT"
    assert task_outcome("CANCELLED by 0", stopping=True) == "stopped"
    assert task_outcome("COMPLETED", stopping=True) == "completed"
    plain = combine("9", parse_squeue("9|N/A|9|COMPLETED|None|0|1|d|\n"), None)
    _, events, _ = advance({"job_id": "9", "phase": "running"}, plain, None, 0, 1.0)
    assert not [e for e in events if e.get("kind") == "task_ended"]  # a plain job has no tasks


def test_a_shard_that_is_a_task_shows_its_own_end_else_its_jobs_state() -> None:
    assert task_state("running", "failed") == "failed"
    assert task_state("running", None) == "running"
    assert task_state("stopped", None) == "stopped"
    assert task_state("failed", "completed") == "completed"


def test_mixed_hosts_the_slurm_hosts_shards_become_one_array_the_others_stay_jobs() -> None:
    spec = parse_spec(
        {"host": ["hpc", "gpu"], "shards": 3, "model": "/m", "dataset": "/d.jsonl", "output_dir": "/o"}
    )
    gpus = json.dumps([{"index": i} for i in range(2)])
    hosts = {"hpc": {"scheduler": "slurm", "gpus_json": gpus}, "gpu": {"gpus_json": gpus}}
    jobs = shard_jobs(spec, hosts)
    # the login node's own GPUs are not handed out: Slurm places the tasks
    assert [(j.index, j.host, j.gpus) for j in jobs] == [(0, "hpc", None), (1, "gpu", (0,)), (2, "hpc", None)]
    arrays = slurm_arrays(jobs, hosts)
    assert {h: [j.index for j in js] for h, js in arrays.items()} == {"hpc": [0, 2]}
    one = job_document(array_spec(spec, "hpc"))
    assert one["host"] == "hpc" and "shards" not in one and one.get("shard") is None
    assert parse_spec(one).shards == 1


def test_a_pending_task_cancelled_alone_leaves_no_record_and_is_taken_as_cancelled() -> None:
    """Slurm 22.05 drops a pending task cancelled with ``scancel JOB_1`` from the array's pending range."""
    assert task_ids("[0-1]") == [0, 1] and task_ids("0,2-6:2%1") == [0, 2, 4, 6] and task_ids("N/A") == []
    rec = {"job_id": "2", "array": 2, "phase": "submitted", "tasks": {"0": "PENDING", "1": "PENDING"}}
    look = combine("2", parse_squeue("2|[0]|2|PENDING|BeginTime|0|1|d|\n"), [0, 1])
    assert look is not None and look.phase == "pending"
    rec, events, ended = advance(rec, look, None, 0, 1.0)
    (ev,) = [e for e in events if e["kind"] == "task_ended"]
    assert (ev["fields"]["shard"], ev["fields"]["outcome"]) == (1, "failed") and ended is None
    assert rec["gone"] == [1]
    rec, events, _ = advance(rec, look, None, 0, 2.0)
    assert not [e for e in events if e["kind"] == "task_ended"]  # said once
    # the whole (pending) rest cancelled by a stop: one range row, every task in it ended
    gone = combine("2", parse_squeue("2|[0]|2|CANCELLED|None|0|1|d|\n"), [0])
    assert gone is not None and gone.phase == "ended"
    rec, events, ended = advance(rec, gone, None, 0, 3.0, stopping=True)
    assert [(e["fields"]["shard"], e["fields"]["outcome"]) for e in events if e["kind"] == "task_ended"] == [
        (0, "stopped")
    ]
    assert ended is not None and ended["scheduler_state"] == "CANCELLED"
    both = combine("4", parse_squeue("4|0-1|4|CANCELLED|None|0|1|d|\n"), 2)
    assert both is not None and both.phase == "ended"  # a cancelled pending range covers both tasks


def test_an_array_job_claims_only_its_tasks_still_going_in_the_shared_output_dir(tmp_path: Path) -> None:
    paths = RunPaths(run="arr", dir=tmp_path)
    opts = SlurmOptions.parse({**BASE, "shards": 3, "tasks": [0, 2]})
    assert shard_claim(None, opts) == (3, {0, 2}) and shard_claim((1, 3), None) == (3, {1})
    assert shard_claim(None, None) is None
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "5", "array": 3, "tasks": [0, 2]}))
    (tmp_path / "sched.json").write_text(json.dumps({"tasks": {"0": "RUNNING", "2": "FAILED"}}))
    going = live_claim(None, paths)
    assert going == (3, {0})  # task 2 has ended: a new job of shard 2 may write there
    assert disjoint_shards("/o/", (3, {2}), "/o", going)
    assert not disjoint_shards("/o", (3, {0}), "/o", going)  # shard 0 still being written
    assert not disjoint_shards("/o", (2, {1}), "/o", going)  # another split of the data
    assert not disjoint_shards("/o", None, "/o", going)  # the whole dataset
