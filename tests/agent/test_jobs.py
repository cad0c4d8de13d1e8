"""Jobs with real subprocesses: detached spawn via the supervisor, exit records, stop for real, liveness."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.jobs import control as jobs
from agent.jobs import procfs
from agent.paths import RunPaths, atomic_write_json, read_json, run_paths
from tests.helpers.agentjobs import forker, printer, sleeper, write_script
from tests.helpers.agentproc import cleanup_runs


@pytest.fixture
def state(tmp_path: Path) -> Any:
    st = tmp_path / "state"
    (st / "runs").mkdir(parents=True)
    yield st
    cleanup_runs(st)


def _new(state: Path, run: str) -> RunPaths:
    p = run_paths(state, run)
    p.dir.mkdir()
    return p


def _wait_exit(p: RunPaths, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = read_json(p.exit)
        if isinstance(rec, dict):
            return rec
        time.sleep(0.05)
    raise AssertionError("no exit.json")


def test_spawn_records_job_env_log_and_exit(state: Path, tmp_path: Path) -> None:
    p = _new(state, "r1")
    argv = write_script(
        tmp_path,
        "envjob",
        """
        import os, sys
        print("run", os.environ["EAGLEWATCH_RUN_ID"], "extra", os.environ["EXTRA"], flush=True)
        print("stdin", repr(sys.stdin.read()), "sid", os.getsid(0) == os.getpid(), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        sys.exit(7)
    """,
    )
    rec = jobs.spawn(p, argv, {"EXTRA": "x y"})
    assert rec["argv"] == argv and rec["boot_id"] == procfs.boot_id()
    assert rec["supervisor_pid"] != os.getpid()
    exit_rec = _wait_exit(p)
    assert (exit_rec["code"], exit_rec["signal"]) == (7, None)
    log = p.log.read_text()
    assert "run r1 extra x y" in log
    assert "stdin '' sid True" in log  # stdin is /dev/null; the job leads its own session
    assert "to stderr" in log
    assert read_json(p.job)["pid"] == rec["pid"]


def test_job_is_not_a_child_of_the_spawner(state: Path, tmp_path: Path) -> None:
    p = _new(state, "r2")
    rec = jobs.spawn(p, sleeper(tmp_path), {})
    job_stat = procfs.stat(rec["pid"])
    sup_stat = procfs.stat(rec["supervisor_pid"])
    assert job_stat is not None and sup_stat is not None
    assert job_stat.ppid == rec["supervisor_pid"]
    assert sup_stat.ppid != os.getpid()  # double fork: the daemon dying does not touch the supervisor
    assert job_stat.pgid == rec["pid"]
    assert jobs.classify(p) == "alive"


def test_signal_exit_is_recorded(state: Path, tmp_path: Path) -> None:
    p = _new(state, "r3")
    jobs.spawn(
        p, write_script(tmp_path, "segv", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"), {}
    )
    rec = _wait_exit(p)
    assert (rec["code"], rec["signal"], rec["signal_name"]) == (None, signal.SIGSEGV, "SIGSEGV")
    assert jobs.classify(p) == "finished"


def test_spawn_of_missing_program_fails_clearly(state: Path) -> None:
    p = _new(state, "r4")
    with pytest.raises(jobs.SpawnError, match="cannot start /no/such/program"):
        jobs.spawn(p, ["/no/such/program"], {})
    rec = read_json(p.exit)
    assert rec["code"] == 127 and "No such file" in rec["error"]
    assert "cannot start /no/such/program" in p.log.read_text()


def test_stop_sigkills_a_job_ignoring_sigterm(state: Path, tmp_path: Path) -> None:
    p = _new(state, "r5")
    rec = jobs.spawn(p, sleeper(tmp_path, ignore_term=True), {})
    _wait_log(p, "sleeping")
    result = jobs.stop(p, grace_s=0.5)
    assert result["confirmed"] is True and result["remaining"] == []
    killed = {k["pid"]: k for k in result["killed"]}
    assert killed[rec["pid"]]["signal"] == "SIGKILL"
    assert result["gpu_released"] is None  # no GPU on this machine
    assert _wait_exit(p)["signal"] == signal.SIGKILL
    assert read_json(p.stop)["by"] == "client"


def test_stop_kills_a_setsid_child_that_outlives_its_parent(state: Path, tmp_path: Path) -> None:
    p = _new(state, "r6")
    pidfile = tmp_path / "worker.pid"
    rec = jobs.spawn(p, forker(tmp_path, pidfile), {})
    _wait_log(p, "lives on")
    worker = int(pidfile.read_text())
    worker_stat = procfs.stat(worker)
    assert (
        worker_stat is not None and worker_stat.pgid != rec["pid"]
    )  # left the process group: only the run id finds it
    result = jobs.stop(p, grace_s=0.5)
    assert result["confirmed"] is True
    killed = {k["pid"]: k for k in result["killed"]}
    assert {rec["pid"], worker} <= set(killed)
    assert killed[worker]["signal"] == "SIGKILL"  # it ignores SIGTERM
    assert not procfs.is_same_process(worker, None, None)


def test_stop_after_the_job_ended_still_kills_its_leftover_worker(state: Path, tmp_path: Path) -> None:
    p = _new(state, "r6b")
    pidfile = tmp_path / "left.pid"
    jobs.spawn(p, forker(tmp_path, pidfile, parent_exits=True), {})
    assert _wait_exit(p)["code"] == 0
    worker = int(pidfile.read_text())
    assert procfs.is_same_process(
        worker, None, None
    )  # the vLLM-worker case: the job is gone, its GPU holder is not
    assert jobs.classify(p) == "finished"
    result = jobs.stop(p, grace_s=0.3)
    assert [k["pid"] for k in result["killed"]] == [worker] and result["confirmed"] is True
    assert not procfs.is_same_process(worker, None, None)


def test_stop_of_a_quick_job_reports_sigterm(state: Path, tmp_path: Path) -> None:
    p = _new(state, "r7")
    rec = jobs.spawn(p, sleeper(tmp_path), {})
    _wait_log(p, "sleeping")
    result = jobs.stop(p, grace_s=5)
    assert [(k["pid"], k["signal"]) for k in result["killed"]] == [(rec["pid"], "SIGTERM")]
    assert _wait_exit(p)["signal"] == signal.SIGTERM


@pytest.mark.parametrize("fake", ["dead_pid", "other_boot", "reused_pid"])
def test_classify_lost(state: Path, fake: str) -> None:
    p = _new(state, f"lost-{fake}")
    me = procfs.stat(os.getpid())
    assert me is not None
    record = {"pid": os.getpid(), "start_time": me.start_time, "boot_id": procfs.boot_id()}
    if fake == "dead_pid":
        record["pid"] = _dead_pid()
    elif fake == "other_boot":
        record["boot_id"] = "00000000-0000-0000-0000-000000000000"
    else:
        record["start_time"] = me.start_time + 1  # same pid, another process
    atomic_write_json(p.job, record)
    assert jobs.classify(p) == "lost"
    record.update(pid=os.getpid(), start_time=me.start_time, boot_id=procfs.boot_id())
    atomic_write_json(p.job, record)
    assert jobs.classify(p) == "alive"


def test_stop_finds_nothing_for_an_ended_run(state: Path, tmp_path: Path) -> None:
    p = _new(state, "r8")
    jobs.spawn(p, printer(tmp_path, ["hi"]), {})
    _wait_exit(p)
    result = jobs.stop(p, grace_s=1)
    assert result["killed"] == [] and result["confirmed"] is True


def _dead_pid() -> int:
    proc = os.fork()
    if proc == 0:
        os._exit(0)
    os.waitpid(proc, 0)
    return proc


def _wait_log(p: RunPaths, text: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.log.exists() and text in p.log.read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} not in log: {p.log.read_text() if p.log.exists() else ''}")


def test_supervisor_usage_error() -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "agent.jobs.supervise"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 2 and "usage" in out.stderr


def test_processes_older_than_the_job_are_passed_over() -> None:
    """run_processes(born_after=…): a process carrying the run id but older than the bound is not read (none
    can descend from the job); one born at or after it is found."""
    import subprocess

    env = {**os.environ, "EAGLEWATCH_RUN_ID": "r-born-after"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        deadline = time.monotonic() + 10
        while not procfs.environ_has(proc.pid, b"EAGLEWATCH_RUN_ID=r-born-after"):  # exec'd by now
            assert time.monotonic() < deadline
            time.sleep(0.01)
        born = procfs.start_time(proc.pid)
        assert born is not None
        assert jobs.run_processes("r-born-after", None, set()) == [proc.pid]
        assert jobs.run_processes("r-born-after", None, set(), born_after=born) == [proc.pid]
        assert jobs.run_processes("r-born-after", None, set(), born_after=born + 1) == []
    finally:
        proc.kill()
        proc.wait()
