"""Pure Slurm bookkeeping: states mapped, squeue rows parsed and combined, looks advanced, options checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.paths import RunPaths
from agent.runs.summary import RunSummary, final_state
from agent.sched.jobs import advance, exit_record
from agent.sched.logmerge import LogMerger, shard_of
from agent.sched.options import SlurmOptions, sbatch_arg_problem
from agent.sched.slurmstate import (
    STATES,
    SlurmParseError,
    combine,
    exit_fields,
    parse_sacct,
    parse_squeue,
    state_of,
)


@pytest.mark.parametrize(
    ("state", "phase", "outcome"),
    [
        ("PENDING", "pending", None),
        ("CONFIGURING", "pending", None),
        ("REQUEUED", "pending", None),
        ("RUNNING", "running", None),
        ("COMPLETING", "running", None),
        ("SUSPENDED", "running", None),
        ("COMPLETED", "ended", "completed"),
        ("FAILED", "ended", "failed"),
        ("CANCELLED", "ended", "cancelled"),
        ("CANCELLED by 0", "ended", "cancelled"),
        ("TIMEOUT", "ended", "failed"),
        ("NODE_FAIL", "ended", "failed"),
        ("OUT_OF_MEMORY", "ended", "failed"),
        ("PREEMPTED", "ended", "failed"),
        ("BOOT_FAIL", "ended", "failed"),
        ("DEADLINE", "ended", "failed"),
        ("SOMETHING_NEW", "running", None),  # never ended on a guess
    ],
)
def test_every_slurm_state_maps_to_a_run_phase(state: str, phase: str, outcome: str | None) -> None:
    got = state_of(state)
    assert (got.phase, got.outcome) == (phase, outcome)
    assert got.meaning


def test_every_ended_state_has_an_outcome() -> None:
    assert all(s.outcome for s in STATES.values() if s.phase == "ended")
    assert not any(s.outcome for s in STATES.values() if s.phase != "ended")


SQUEUE = """\
7|N/A|7|PENDING|Priority|0|100|gpu|
6|N/A|6|PENDING|Resources|0|200|gpu|
5|0|9|RUNNING|None|0|4294901759|gpu|
5|1|5|TIMEOUT|TimeLimit|15|4294901759|gpu|
8|0-1|8|PENDING|Priority|0|50|gpu|
"""


def test_squeue_rows_and_a_pending_job_position() -> None:
    rows = parse_squeue(SQUEUE)
    assert [(r.job_id, r.task) for r in rows] == [
        ("7", None),
        ("6", None),
        ("5", "0"),
        ("5", "1"),
        ("8", "0-1"),
    ]
    seven = combine("7", rows, None)
    assert seven is not None and seven.phase == "pending" and seven.reason == "Priority"
    assert seven.position == 2  # job 6 has the higher priority
    assert "reason Priority, position 2" in seven.describe()
    assert combine("8", rows, 2).position == 3  # type: ignore[union-attr]
    assert combine("99", rows, None) is None
    with pytest.raises(SlurmParseError, match="expected 8"):
        parse_squeue("1|2|3\n")


def test_an_array_ends_with_its_worst_task_only_once_all_have_ended() -> None:
    rows = parse_squeue(SQUEUE)
    running = combine("5", rows, 2)
    assert running is not None and running.phase == "running"
    ended = parse_squeue("5|0|9|COMPLETED|None|0|1|gpu|\n5|1|5|TIMEOUT|TimeLimit|15|1|gpu|\n")
    view = combine("5", ended, 2)
    assert view is not None and (view.phase, view.state, view.outcome) == ("ended", "TIMEOUT", "failed")
    assert view.tasks == {"0": "COMPLETED", "1": "TIMEOUT"}
    one_seen = combine("5", ended[:1], 2)  # task 1 not listed (yet): not over
    assert one_seen is not None and one_seen.phase == "running"


def test_exit_status_and_sacct() -> None:
    assert exit_fields(768) == {"code": 3, "signal": None, "signal_name": None}
    assert exit_fields(15) == {"code": None, "signal": 15, "signal_name": "SIGTERM"}
    view = parse_sacct("12|CANCELLED by 0|0:15\n13|COMPLETED|0:0\n", "12")
    assert view is not None and view.state == "CANCELLED" and view.outcome == "cancelled"
    assert parse_sacct("", "12") is None


def test_advance_journals_queue_changes_start_and_end_once() -> None:
    pending = combine("7", parse_squeue(SQUEUE), None)
    rec, events, ended = advance({"job_id": "7"}, pending, None, 0, 1.0)
    assert [e["kind"] for e in events] == ["queued"] and events[0]["fields"]["reason"] == "Priority"
    assert ended is None and rec["phase"] == "pending"
    rec, events, _ = advance(rec, pending, None, 0, 2.0)
    assert events == []  # same reason: nothing new in the timeline
    rec, events, _ = advance(rec, None, "squeue failed: Slurm is not reachable", 0, 3.0)
    assert [e["fields"]["rule"] for e in events] == ["slurm_unreachable"] and not rec.get("vanished")
    rec, events, _ = advance(rec, None, "squeue failed again", 0, 4.0)
    assert events == []  # one warning per outage
    timeout = combine("5", parse_squeue("5|N/A|5|TIMEOUT|TimeLimit|15|1|gpu|\n"), None)
    rec, events, ended = advance(rec, timeout, None, 3, 5.0)
    # it ran and ended between two looks: the run was running before it ended
    assert [e.get("state") or e["kind"] for e in events] == ["running", "scheduled"]
    assert ended is not None and ended["scheduler_state"] == "TIMEOUT" and ended["signal_name"] == "SIGTERM"
    rec, _, _ = advance(rec, None, None, 3, 6.0)
    assert rec["vanished"] is True


def test_a_requeued_job_is_pending_again_and_a_cancelled_queued_job_never_ran() -> None:
    running = combine("5", parse_squeue("5|N/A|5|RUNNING|None|0|1|gpu|\n"), None)
    requeued = combine("5", parse_squeue("5|N/A|5|PENDING|BeginTime|0|1|gpu|\n"), None)
    cancelled = combine("5", parse_squeue("5|N/A|5|CANCELLED|None|0|1|gpu|\n"), None)
    rec, events, _ = advance({"job_id": "5"}, running, None, 0, 1.0)
    assert [e.get("state") for e in events] == ["running", None]
    rec, events, _ = advance(rec, requeued, None, 0, 2.0)
    assert [e.get("state") or e["kind"] for e in events] == ["pending", "queued"]
    _, events, ended = advance({"job_id": "5", "phase": "pending"}, cancelled, None, 0, 3.0)
    assert events == [] and ended is not None and ended["scheduler_state"] == "CANCELLED"


def test_final_state_of_slurm_outcomes() -> None:
    summary = RunSummary()
    for state, want in [("TIMEOUT", "failed"), ("OUT_OF_MEMORY", "failed"), ("CANCELLED", "failed")]:
        view = combine("1", parse_squeue(f"1|N/A|1|{state}|x|9|1|p|\n"), None)
        assert view is not None
        got, reason = final_state(exit_record(view, 10.0), None, summary, "command")
        assert got == want and reason.startswith(state), reason
    view = combine("1", parse_squeue("1|N/A|1|CANCELLED|x|0|1|p|\n"), None)
    assert view is not None
    stop = {"requested_at": 5.0, "by": "client", "reason": "stopped by request"}
    assert final_state(exit_record(view, 10.0), stop, summary, "command")[0] == "stopped"
    done = combine("1", parse_squeue("1|N/A|1|COMPLETED|None|0|1|p|\n"), None)
    assert done is not None
    assert final_state(exit_record(done, 10.0), None, summary, "command") == ("completed", "exit code 0")


def test_options_refuse_what_eaglewatch_sets_and_name_the_field() -> None:
    assert sbatch_arg_problem("--qos=high") is None
    assert "set by eaglewatch" in (sbatch_arg_problem("--output=/tmp/x") or "")
    assert "one long option" in (sbatch_arg_problem("-p gpu") or "")
    assert "one long option" in (sbatch_arg_problem("--x=1\n--y") or "")
    with pytest.raises(ValueError, match=r"scheduler\.partition"):
        SlurmOptions.parse({"kind": "slurm", "partition": "gpu; rm -rf /"})
    with pytest.raises(ValueError, match=r"scheduler\.gpus"):
        SlurmOptions.parse({"kind": "slurm", "gpus": "lots"})
    opts = SlurmOptions.parse({"kind": "slurm", "account": "lab", "shards": 2, "sbatch_args": ["--qos=x"]})
    assert (opts.account, opts.shards, opts.sbatch_args) == ("lab", 2, ["--qos=x"])


def test_log_merge_tags_lines_and_redoes_an_interrupted_append_exactly_once(tmp_path: Path) -> None:
    paths = RunPaths(run="m", dir=tmp_path)
    (tmp_path / "output.task-0.log").write_bytes(b"a0\nb0\npart")
    (tmp_path / "output.task-1.log").write_bytes(b"a1\n")
    merger = LogMerger(paths, 2)
    assert merger.pump()
    assert paths.log.read_bytes() == b"[shard 0] a0\n[shard 0] b0\n[shard 1] a1\n"
    assert not merger.pump()  # the unterminated line waits for its end
    # A crash after the intent was written and half the bytes appended: a new merger cuts and redoes it.
    with open(tmp_path / "output.task-0.log", "ab") as f:
        f.write(b"ial\n")
    import json

    base = paths.log.stat().st_size
    (tmp_path / "merge.json").write_text(
        json.dumps({"offsets": [6, 3], "intent": {"base": base, "task": 0, "end": 14}})
    )
    with open(paths.log, "ab") as f:
        f.write(b"[shard 0] par")
    LogMerger(paths, 2)
    assert paths.log.read_bytes().endswith(b"[shard 1] a1\n[shard 0] partial\n")
    assert paths.log.read_bytes().count(b"partial") == 1
    assert shard_of("[shard 12] text") == (12, "text") and shard_of("plain") == (None, "plain")


def test_an_array_task_is_told_its_shard(tmp_path: Path) -> None:
    """The batch script's program (python -m agent.sched.task) as a real subprocess, as Slurm starts it."""
    import json
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    show = "import os, sys; print(sys.argv[1:], os.environ['X'], os.environ['EAGLEWATCH_SHARD'])"
    argv = [sys.executable, "-c", show, "--spec", "s.json"]
    (run_dir / "launch.json").write_text(json.dumps({"argv": argv, "env": {"X": "1"}, "shards": 3}))
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "2"}
    out = subprocess.run(
        [sys.executable, "-m", "agent.sched.task", str(run_dir)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['--spec', 's.json'] 1 2/3"
    (run_dir / "launch.json").write_text(json.dumps({"argv": ["/nonexistent/prog"]}))
    bad = subprocess.run(
        [sys.executable, "-m", "agent.sched.task", str(run_dir)], capture_output=True, text=True
    )
    assert bad.returncode == 127 and "cannot start /nonexistent/prog" in bad.stderr
