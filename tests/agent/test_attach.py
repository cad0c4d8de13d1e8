"""Attach: a real agent daemon watches jobs it did not start, by pid, by log and by output dir.

The job is tests/web/fake_vllm_job.py, a stand-in for a GPU extraction (no GPU here): it prints vLLM's
own milestone lines and writes capture files, started by the test (not by the agent) with its output going
to a log file, as a user's job started by hand would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agent.jobs import procfs
from agent.paths import read_json, run_paths
from agent.spec import parse_spec
from tests.helpers.agentjobs import marker
from tests.helpers.agentproc import (
    AgentClient,
    AgentError,
    AgentProc,
    cleanup_runs,
    start_agent,
    terminal_event,
)

FAKE_JOB = Path(__file__).resolve().parents[1] / "web" / "fake_vllm_job.py"
Start = Callable[..., "subprocess.Popen[bytes]"]


@pytest.fixture
def user_jobs() -> Iterator[Start]:
    """Start fake_vllm_job.py as the user would (its own session, stdout to a log); kill what is left."""
    started: list[subprocess.Popen[bytes]] = []

    def start(log: Path, *args: str, argv: list[str] | None = None) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv or [sys.executable, str(FAKE_JOB), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[list[AgentProc]]:
    """A daemon (the list's last), restartable by appending; every one is killed at the end."""
    procs = [start_agent(tmp_path / "state")]
    yield procs
    for proc in procs:
        proc.kill()
    cleanup_runs(tmp_path / "state")


def _spec(**fields: Any) -> dict[str, Any]:
    """A spec as the controller sends it: checked by the pydantic model, defaults filled in."""
    return parse_spec({"name": "attached", "host": "gpu1", **fields}).model_dump(mode="json")


def _follow_to_end(sock: Path, run: str, timeout: float = 40.0) -> list[dict[str, Any]]:
    """Every journal event of ``run`` up to its final state."""
    with AgentClient(sock) as c:
        c.result("follow", run=run, after_seq=0)
        msgs = c.wait_for(terminal_event, timeout=timeout)
    return [m["event"] for m in msgs if m.get("type") == "event"]


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events if e["type"] == "milestone"]


def _wait(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)


def test_attach_by_pid_and_log_watches_like_a_launched_run(
    agent: list[AgentProc], tmp_path: Path, user_jobs: Start
) -> None:
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    job = user_jobs(log, str(out), "--progress", "3", "--delay", "0.3", "--files", "good", "--capture")
    spec = _spec(
        attach={"pid": job.pid, "log": str(log)}, output_dir=str(out), expect={"layers": 2, "hidden_size": 64}
    )
    with AgentClient(agent[-1].socket) as c:
        reply = c.result("launch", run="a1", spec=spec)
    assert reply["attached"] is True and reply["pid"] == job.pid
    events = _follow_to_end(agent[-1].socket, "a1")
    kinds = _kinds(events)
    for kind in ("launched", "weights_loaded", "kv_cache_ready", "engine_ready", "progress", "completed"):
        assert kind in kinds, (kind, kinds)
    checks = {e["file"]: e["ok"] for e in events if e["type"] == "check"}
    assert checks == {f"hs_{i}.safetensors": True for i in range(3)}
    final = events[-1]
    assert final["state"] == "completed"
    assert final["exit"] == {"code": None, "signal": None}  # not our child: no exit status is invented
    assert "exit status unknown" in final["reason"] and "completion marker" in final["reason"]
    assert job.wait(5) == 0


def test_a_pid_alone_is_followed_with_the_log_its_output_goes_to(
    agent: list[AgentProc], tmp_path: Path, user_jobs: Start
) -> None:
    """`cmd > log 2>&1 &`, then attach by pid alone: the log is found from the process's stdout."""
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    job = user_jobs(log, str(out), "--progress", "2", "--delay", "0.3", "--files", "good", "--capture")
    with AgentClient(agent[-1].socket) as c:
        c.result("launch", run="p1", spec=_spec(attach={"pid": job.pid}))
    events = _follow_to_end(agent[-1].socket, "p1")
    launched = events[0]
    assert launched["kind"] == "launched" and launched["fields"]["attached"]["log"] == str(log)
    assert f"log {log} (its output)" in launched["text"]
    kinds = _kinds(events)
    assert {"engine_ready", "progress", "completed"} <= set(kinds) and "warning" not in kinds, kinds
    assert events[-1]["state"] == "completed" and "printed its completion marker" in events[-1]["reason"]


def test_a_pid_writing_to_a_pipe_is_followed_and_the_missing_log_named(
    agent: list[AgentProc], tmp_path: Path
) -> None:
    job = subprocess.Popen(
        [sys.executable, "-c", "import time; print('hello', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        with AgentClient(agent[-1].socket) as c:
            c.result("launch", run="p2", spec=_spec(attach={"pid": job.pid}))
            c.result("follow", run="p2", after_seq=0)
            got = c.wait_for(lambda m: m.get("type") == "event" and m["event"].get("kind") == "warning")
        warning = got[-1]["event"]
        assert warning["fields"] == {"rule": "attach_no_log", "pid": job.pid}
        assert "terminal or a pipe" in warning["text"] and "attach.log" in warning["text"]
        assert "log" not in got[0]["event"]["fields"]["attached"]
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate(timeout=10)


def test_a_child_that_outlives_the_attached_pid_keeps_the_run_going(
    agent: list[AgentProc], tmp_path: Path, user_jobs: Start
) -> None:
    out, log, go = tmp_path / "out", tmp_path / "job.log", tmp_path / "go"
    # A launcher that starts the job and exits once told to (the job is re-parented, still a descendant).
    launcher = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {str(FAKE_JOB)!r}, {str(out)!r}, '--hang'])\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
    )
    parent = user_jobs(log, argv=[sys.executable, "-c", launcher])
    with AgentClient(agent[-1].socket) as c:
        c.result("launch", run="tree", spec=_spec(attach={"pid": parent.pid, "log": str(log)}))
    paths = run_paths(agent[-1].state_dir, "tree")

    def tree() -> list[list[int]]:
        job = read_json(paths.job)
        return job["tree"] if isinstance(job, dict) else []

    _wait(lambda: len(tree()) == 2)
    child = next(pid for pid, _ in tree() if pid != parent.pid)
    go.touch()
    assert parent.wait(10) == 0
    with AgentClient(agent[-1].socket) as c:
        c.result("follow", run="tree", after_seq=0)
        # engine_ready comes from the child's lines after its parent exited, and the run goes on
        c.wait_for(lambda m: m.get("type") == "event" and m["event"].get("kind") == "engine_ready")
        _wait(lambda: tree() == [[child, procfs.start_time(child)]])
        assert c.result("status", run="tree")["state"] == "running"
        os.kill(child, signal.SIGKILL)
        final = c.wait_for(terminal_event, timeout=20)[-1]["event"]
    assert final["state"] == "lost" and "the job ended; exit status unknown" in final["reason"]
    assert "no completion marker" in final["reason"]


def test_killed_midway_ends_the_run_with_what_it_wrote(
    agent: list[AgentProc], tmp_path: Path, user_jobs: Start
) -> None:
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    job = user_jobs(log, str(out), "--progress", "200", "--delay", "0.2", "--files", "good")
    spec = _spec(attach={"pid": job.pid, "log": str(log)}, output_dir=str(out), expect={"layers": 2})
    with AgentClient(agent[-1].socket) as c:
        c.result("launch", run="k1", spec=spec)
        c.result("follow", run="k1", after_seq=0)
        seen: set[str] = set()

        def checked_and_counted(m: dict[str, Any]) -> bool:
            """A file checked and a progress line read: the job prints the line just after the file, so
            under load either may come first."""
            if m.get("type") == "event":
                seen.add("check" if m["event"].get("type") == "check" else str(m["event"].get("kind")))
            return {"check", "progress"} <= seen

        before = c.wait_for(checked_and_counted)
        os.killpg(job.pid, signal.SIGKILL)
        msgs = before + c.wait_for(terminal_event, timeout=20)
        events = [m["event"] for m in msgs if m.get("type") == "event"]
    assert job.wait(5) == -signal.SIGKILL
    final = events[-1]
    # never a success: the agent is not its parent, and the log has no completion marker
    assert final["state"] == "lost" and final["exit"] == {"code": None, "signal": None}
    assert "exit status unknown" in final["reason"] and "printed no completion marker" in final["reason"]
    checked = set(json.loads(run_paths(agent[-1].state_dir, "k1").cursor.read_text())["checked"])
    checked.discard(".")  # the whole directory's index-gap check, once at the end (if this cursor has it)
    assert checked and checked <= {p.name for p in out.iterdir()}
    done = [e["fields"]["samples_done"] for e in events if e.get("kind") == "progress"]
    assert done and max(done) < 200 * 8


def test_attach_by_log_from_now_then_stop_only_detaches(
    agent: list[AgentProc], tmp_path: Path, user_jobs: Start
) -> None:
    log = tmp_path / "job.log"
    old = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    log.write_text(f"{old}\n{marker('progress', samples_done=1, samples_total=9)}\n")
    writer = (
        "import json, sys, time\n"
        f"with open({str(log)!r}, 'a') as fh:\n"
        "    for i in range(2, 10):\n"
        "        rec = {'kind': 'progress', 'samples_done': i, 'samples_total': 9}\n"
        "        fh.write('EAGLEWATCH ' + json.dumps(rec) + '\\n')\n"
        "        fh.flush(); time.sleep(0.2)\n"
        "    time.sleep(600)\n"
    )
    with AgentClient(agent[-1].socket) as c:
        c.result("launch", run="l1", spec=_spec(attach={"log": str(log), "from_start": False}))
        job = user_jobs(tmp_path / "writer.out", argv=[sys.executable, "-c", writer])
        c.result("follow", run="l1", after_seq=0, log_offset=0)
        msgs = c.wait_for(
            lambda m: m.get("type") == "event" and m["event"].get("fields", {}).get("samples_done") == 9
        )
        msgs += c.wait_for(lambda m: m.get("type") == "log_block" and '"samples_done": 9' in m["text"])
        read = c.result("read_log", run="l1", offset=0)
        stopped = c.result("stop", run="l1")
        msgs += c.wait_for(terminal_event, timeout=20)
    events = [m["event"] for m in msgs if m.get("type") == "event"]
    assert stopped["detached"] is True and stopped["killed"] == []
    assert job.poll() is None and procfs.is_same_process(job.pid, None, None)  # never signalled
    assert "error" not in _kinds(events)  # the OOM line was written before attaching
    done = [e["fields"]["samples_done"] for e in events if e.get("kind") == "progress"]
    assert done == list(range(2, 10))
    assert events[-1]["state"] == "stopped" and "detached, the job was not signalled" in events[-1]["reason"]
    # the log shown starts where watching did: followed from offset 0, or read from there
    start = len(f"{old}\n{marker('progress', samples_done=1, samples_total=9)}\n".encode())
    shown = [m for m in msgs if m.get("type") == "log_block"]
    assert shown[0]["offset"] == start and read["offset"] == start, (shown[0]["offset"], read["offset"])
    text = "\n".join(m["text"] for m in shown) + read["data"]
    assert "OutOfMemoryError" not in text and '"samples_done": 1,' not in text
    assert [f'"samples_done": {i},' in text for i in range(2, 10)] == [True] * 8


def test_allow_stop_stops_the_attached_tree(agent: list[AgentProc], tmp_path: Path, user_jobs: Start) -> None:
    log = tmp_path / "job.log"
    job = user_jobs(log, str(tmp_path / "out"), "--hang")
    with AgentClient(agent[-1].socket) as c:
        c.result("launch", run="s1", spec=_spec(attach={"pid": job.pid, "log": str(log), "allow_stop": True}))
        stopped = c.result("stop", run="s1", grace_s=5)
        assert stopped["confirmed"] is True and [k["pid"] for k in stopped["killed"]] == [job.pid]
        assert c.result("status", run="s1")["state"] == "stopped"
    assert job.wait(5) == -signal.SIGTERM


def test_attach_by_output_dir_checks_files_against_expectations_then_idles_out(
    agent: list[AgentProc], tmp_path: Path, user_jobs: Start
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    # the expectations come from the model's config.json (hidden size 32) and the layer ids (2 per token)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 32}))
    spec = _spec(attach={"idle_timeout_s": 2}, output_dir=str(out), model=str(model), layers=[2, 4])
    with AgentClient(agent[-1].socket) as c:
        c.result("launch", run="d1", spec=spec)
    user_jobs(tmp_path / "job.log", str(out), "--progress", "2", "--delay", "0.1", "--files", "drop-layer")
    events = _follow_to_end(agent[-1].socket, "d1")
    problems = {p["code"] for e in events if e["type"] == "check" for p in e["problems"]}
    assert {e["file"] for e in events if e["type"] == "check"} == {"hs_0.safetensors", "hs_1.safetensors"}
    assert {"layer_count_mismatch", "hidden_size_mismatch"} <= problems
    final = events[-1]
    assert final["state"] == "completed" and "idle timeout" in final["reason"]


def test_restarted_agent_carries_on_watching_the_attached_job(
    agent: list[AgentProc], tmp_path: Path, user_jobs: Start
) -> None:
    out, log, gate = tmp_path / "out", tmp_path / "job.log", tmp_path / "gate"
    gate.write_text("0")
    out.mkdir()
    job = user_jobs(
        log, str(out), "--progress", "6", "--wait-file", str(gate), "--files", "good", "--capture"
    )
    spec = _spec(attach={"pid": job.pid, "log": str(log)}, output_dir=str(out), expect={"layers": 2})
    with AgentClient(agent[-1].socket) as c:
        c.result("launch", run="r1", spec=spec)
        c.result("follow", run="r1", after_seq=0)
        gate.write_text("3")
        c.wait_for(
            lambda m: m.get("type") == "event" and m["event"].get("fields", {}).get("samples_done") == 24
        )
    agent[-1].kill()  # SIGKILL mid-run; the job goes on without it
    gate.write_text("6")
    agent.append(start_agent(agent[-1].state_dir))
    events = _follow_to_end(agent[-1].socket, "r1")
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    done = [e["fields"]["samples_done"] for e in events if e.get("kind") == "progress"]
    assert done == [8 * i for i in range(1, 7)]  # each once, across the restart
    assert sorted(e["file"] for e in events if e["type"] == "check") == [
        f"hs_{i}.safetensors" for i in range(6)
    ]
    assert events[-1]["state"] == "completed" and job.wait(5) == 0


@pytest.mark.parametrize(
    ("attach", "output_dir", "field"),
    [
        ({"pid": 4_000_000}, None, "attach.pid"),
        ({"log": "/nonexistent/job.log"}, None, "attach.log"),
        ({}, "/nonexistent/out", "output_dir"),
    ],
)
def test_what_an_attach_names_must_exist_before_anything_starts(
    agent: list[AgentProc], attach: dict[str, Any], output_dir: str | None, field: str
) -> None:
    spec = _spec(attach=attach, output_dir=output_dir)
    with AgentClient(agent[-1].socket) as c, pytest.raises(AgentError) as err:
        c.result("launch", run="bad", spec=spec)
    assert err.value.code == "bad_args" and err.value.reply["message"].startswith(f"spec.{field}: ")
    assert not run_paths(agent[-1].state_dir, "bad").dir.exists()


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"attach": {}}, "attach needs something to watch: attach.pid, attach.log"),
        ({"attach": {"pid": 5}, "command": ["x"]}, "leave 'command' out"),
        ({"attach": {"pid": 5}, "backend": "speculators"}, "leave 'backend' out"),
        ({"attach": {"pid": 5, "slurm_job": "7"}}, "a pid or a slurm_job, not both"),
        ({"attach": {"slurm_job": "7", "idle_timeout_s": 60}}, "does not apply to a slurm_job"),
        ({"attach": {"pid": 5}, "on_shape_failure": "stop"}, "set attach.allow_stop or use 'alert'"),
        ({"attach": {"pid": 5}, "shards": 2}, "'shards', 'shard' and 'resume' do not apply"),
        ({"attach": {"log": "job.log"}}, "must be an absolute path on the host"),
        ({"attach": {"slurm_job": "12; rm"}}, "slurm_job must be a Slurm job id (digits only)"),
        ({"attach": {"pid": "5"}}, "valid integer"),
        ({"attach": {"pid": 5, "idle_timeout_s": 0}}, "greater than or equal to 1"),
        ({"attach": {"pdi": 5}}, "not a spec field: did you mean pid?"),
    ],
)
def test_an_attach_spec_is_checked_before_anything_starts(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({"host": "gpu1", **fields})
    assert words in str(err.value)
