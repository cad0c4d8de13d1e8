"""The daemon end to end over its Unix socket: launch, follow (events + log lines), status, stop, checks."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.paths import read_json, run_paths
from tests.helpers.agentjobs import OOM_TRACEBACK, VLLM_LINES, forker, marker, printer, sleeper, write_script
from tests.helpers.agentproc import (
    AgentClient,
    AgentError,
    AgentProc,
    agent_daemon,
    last_log_text,
    log_lines,
    terminal_event,
)

__all__ = ["agent_daemon"]


def _cmd(argv: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": "t", "host": "local", "backend": "command", "command": argv, **extra}


def _events(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["event"] for m in msgs if m.get("type") == "event"]


def _log_lines(msgs: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [line for m in msgs for line in log_lines(m)]


def test_launch_follow_to_completion(agent_daemon: AgentProc, tmp_path: Path) -> None:
    lines = [*VLLM_LINES, marker("progress", samples_done=4, samples_total=8), "tqdm 50%\rtqdm 100%"]
    with AgentClient(agent_daemon.socket) as c:
        assert c.hello["type"] == "hello" and c.hello["protocol"] == 1
        res = c.result("launch", run="ok-1", spec=_cmd(printer(tmp_path, lines, delay=0.02)))
        assert res["run"] == "ok-1" and isinstance(res["pid"], int) and isinstance(res["start_time"], int)
        follow = c.result("follow", run="ok-1", after_seq=0, log_offset=0)
        assert follow["run"] == "ok-1"
        msgs = c.wait_for(terminal_event)
        events = _events(msgs)
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        assert events[0]["kind"] == "launched" and events[1] == {
            **events[1],
            "type": "state",
            "state": "running",
        }
        assert events[-1]["state"] == "completed" and events[-1]["exit"] == {"code": 0, "signal": None}
        kinds = [e.get("kind") for e in events if e["type"] == "milestone"]
        assert {"engine_config", "weights_loaded", "progress"} <= set(kinds)
        progress = next(e for e in events if e.get("kind") == "progress")
        assert progress["fields"]["samples_done"] == 4
        # Every log line arrives (tqdm's \r splits lines), with its byte offset in output.log.
        if not any(t == "tqdm 100%" for _, t in _log_lines(msgs)):
            msgs += c.wait_for(lambda m: last_log_text(m) == "tqdm 100%", 10)
        got = _log_lines(msgs)
        assert [t for _, t in got] == [*lines[:-1], "tqdm 50%", "tqdm 100%"]
        raw = run_paths(agent_daemon.state_dir, "ok-1").log.read_bytes()
        for offset, text in got:
            assert raw[offset:].startswith(text.encode())
        status = c.result("status", run="ok-1")
        assert status["state"] == "completed" and status["last_seq"] == events[-1]["seq"]
        assert status["log_size"] == len(raw)
        listed = c.result("list")["runs"]
        assert [r["run"] for r in listed] == ["ok-1"]
        page = c.result("read_log", run="ok-1", offset=0, limit=10)
        assert page["data"] == raw[:10].decode() and page["next_offset"] == 10 and page["size"] == len(raw)


def test_launch_rejects_bad_requests(agent_daemon: AgentProc, tmp_path: Path) -> None:
    with AgentClient(agent_daemon.socket) as c:
        argv = sleeper(tmp_path, seconds=30)
        c.result("launch", run="dup", spec=_cmd(argv))
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"run": "dup", "spec": _cmd(argv)}, "conflict", "already exists"),
            ({"run": "../x", "spec": _cmd(argv)}, "bad_args", "run id"),
            ({"run": "a" * 65, "spec": _cmd(argv)}, "bad_args", "run id"),
            ({"run": "x1", "spec": "nope"}, "bad_args", "JSON object"),
            ({"run": "x2", "spec": {"backend": "command", "command": []}}, "bad_args", "spec.command"),
            ({"run": "x3", "spec": {"backend": "shell"}}, "bad_args", "spec.backend"),
            ({"run": "x4", "spec": _cmd(argv, env={"BAD NAME": "1"})}, "bad_args", "spec.env"),
            ({"run": "x5", "spec": _cmd(argv, rules=[{"nonsense": 1}])}, "bad_args", "spec.rules"),
        ]
        for args, code, words in cases:
            msg = c.request("launch", **args)
            assert msg["type"] == "error" and msg["code"] == code, (args, msg)
            assert words in msg["message"], msg
        assert not run_paths(agent_daemon.state_dir, "x5").dir.exists()  # nothing left behind
        missing = c.request("status", run="nope")
        assert missing["code"] == "not_found"
        assert c.request("stop", run="dup", grace_s=-1)["code"] == "bad_args"
        assert c.request("follow", run="dup", after_seq="x")["code"] == "bad_args"


def test_launch_of_missing_program_is_a_failed_run(agent_daemon: AgentProc) -> None:
    with AgentClient(agent_daemon.socket) as c:
        msg = c.request("launch", run="nope", spec=_cmd(["/no/such/binary"]))
        assert msg["type"] == "error" and msg["code"] == "failed" and "/no/such/binary" in msg["message"]
        c.result("follow", run="nope", after_seq=0)
        last = c.wait_for(terminal_event)[-1]["event"]
        assert last["state"] == "failed" and "could not start" in last["reason"]


def test_crash_with_oom_traceback_fails_naming_code_and_error(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    with AgentClient(agent_daemon.socket) as c:
        c.result(
            "launch", run="oom", spec=_cmd(printer(tmp_path, [VLLM_LINES[0], *OOM_TRACEBACK], exit_code=3))
        )
        c.result("follow", run="oom", after_seq=0)
        events = _events(c.wait_for(terminal_event))
        errors = [e for e in events if e.get("kind") == "error"]
        assert errors and errors[0]["fields"]["class"] == "oom"
        failed = [e for e in events if e.get("kind") == "failed"]
        assert len(failed) == 1 and "exit code 3" in failed[0]["fields"]["reason"]
        assert events[-1]["state"] == "failed" and "oom" in events[-1]["reason"]
        assert events[-1]["exit"] == {"code": 3, "signal": None}


def test_exit_zero_after_fatal_error_is_failed(agent_daemon: AgentProc, tmp_path: Path) -> None:
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="z", spec=_cmd(printer(tmp_path, OOM_TRACEBACK, exit_code=0)))
        c.result("follow", run="z", after_seq=0)
        last = c.wait_for(terminal_event)[-1]["event"]
        assert last["state"] == "failed" and "exited 0 after a fatal error" in last["reason"]


def test_stop_kills_job_and_escaped_worker(agent_daemon: AgentProc, tmp_path: Path) -> None:
    pidfile = tmp_path / "w.pid"
    with AgentClient(agent_daemon.socket) as c:
        launched = c.result("launch", run="st", spec=_cmd(forker(tmp_path, pidfile)))
        c.result("follow", run="st", after_seq=0, log_offset=0)
        c.wait_for(lambda m: "lives on" in (last_log_text(m) or ""))
        res = c.result("stop", run="st", grace_s=0.5)
        assert res["confirmed"] is True and res["remaining"] == [] and res["gpu_released"] is None
        pids = {k["pid"] for k in res["killed"]}
        assert {launched["pid"], int(pidfile.read_text())} <= pids
        assert res["state"] == "stopped"
        last = c.wait_for(terminal_event)[-1]["event"]
        assert last["state"] == "stopped"
        assert c.result("status", run="st")["state"] == "stopped"


def test_followers_get_backlog_then_live_in_order(agent_daemon: AgentProc, tmp_path: Path) -> None:
    lines = [marker("progress", samples_done=i, samples_total=40) for i in range(40)]
    with AgentClient(agent_daemon.socket) as a:
        a.result("launch", run="ord", spec=_cmd(printer(tmp_path, lines, delay=0.05)))
        a.result("follow", run="ord", after_seq=0)
        first = _events(a.wait_for(lambda m: m.get("type") == "event" and m["event"]["seq"] >= 8))
        with AgentClient(agent_daemon.socket) as b, AgentClient(agent_daemon.socket) as d:
            b.result("follow", run="ord", after_seq=0)
            d.result("follow", run="ord", after_seq=5)
            rest_a = _events(a.wait_for(terminal_event))
            got_b = _events(b.wait_for(terminal_event))
            got_d = _events(d.wait_for(terminal_event))
    seqs_a = [e["seq"] for e in first + rest_a]
    assert seqs_a == list(range(1, len(seqs_a) + 1))
    assert [e["seq"] for e in got_b] == seqs_a
    assert [e["seq"] for e in got_d] == seqs_a[5:]
    assert sum(1 for e in rest_a + first if e.get("kind") == "progress") == 40


def test_live_milestone_goes_out_before_its_line(agent_daemon: AgentProc, tmp_path: Path) -> None:
    """A line read live is journaled first and sent to followers after its milestone: on the way to the
    page the milestone must not queue behind its own line's commit and render."""
    lines = [marker("progress", samples_done=i, samples_total=6) for i in range(6)]
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="first", spec=_cmd(printer(tmp_path, lines, delay=0.2)))
        c.result("follow", run="first", after_seq=0, log_offset=0)
        msgs = c.wait_for(terminal_event)
        if not any(last_log_text(m) == lines[-1] for m in msgs):
            msgs += c.wait_for(lambda m: last_log_text(m) == lines[-1], 10)
    for i, text in enumerate(lines):
        event_at = next(
            n for n, m in enumerate(msgs)
            if m.get("type") == "event" and m["event"].get("kind") == "progress"
            and m["event"]["fields"]["samples_done"] == i
        )  # fmt: skip
        line_at = next(n for n, m in enumerate(msgs) if text in dict(log_lines(m)).values())
        assert event_at < line_at, f"progress {i}: its line went out before its milestone"


def test_unfollow_and_refollow_from_a_seq(agent_daemon: AgentProc, tmp_path: Path) -> None:
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="uf", spec=_cmd(printer(tmp_path, ["a", "b"])))
        c.result("follow", run="uf", after_seq=0)
        c.wait_for(terminal_event)
        assert c.result("unfollow", run="uf")["was_following"] is True
        c.result("follow", run="uf", after_seq=1)
        again = _events(c.wait_for(terminal_event))
        assert again[0]["seq"] == 2


def test_shape_failure_with_stop_policy_stops_the_run(agent_daemon: AgentProc, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = write_script(
        tmp_path,
        "badcap",
        f"""
        import time
        open({str(out / "hs_0.safetensors")!r}, 'wb').write(b'x')
        print('wrote a broken file', flush=True)
        time.sleep(120)
    """,
    )
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="shape", spec=_cmd(argv, output_dir=str(out), on_shape_failure="stop"))
        c.result("follow", run="shape", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=40))
    checks = [e for e in events if e["type"] == "check"]
    assert checks and checks[0]["file"] == "hs_0.safetensors" and checks[0]["ok"] is False
    failed = [e for e in events if e.get("kind") == "shape_check_failed"]
    assert failed and failed[0]["fields"]["code"] == "unreadable"
    assert events[-1]["state"] == "failed"
    assert "unreadable" in events[-1]["reason"] and "hs_0.safetensors" in events[-1]["reason"]


def test_shape_failure_milestone_in_the_log_with_stop_policy_stops_the_run(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    """The job's own check says so in its log: the agent (not the controller) stops the run, once."""
    bad = marker("shape_check_failed", code="hidden_dim_lost", message="hidden states are flat")
    argv = printer(tmp_path, ["capturing", bad], end_sleep=120)
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="shape-ms", spec=_cmd(argv, on_shape_failure="stop"))
        c.result("follow", run="shape-ms", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=40))
    assert [e["kind"] for e in events if e.get("kind") == "shape_check_failed"] == ["shape_check_failed"]
    assert events[-1]["state"] == "failed" and "hidden_dim_lost" in events[-1]["reason"]


@pytest.mark.slow
def test_good_capture_file_passes_and_check_op(agent_daemon: AgentProc, tmp_path: Path) -> None:
    out = tmp_path / "cap"
    out.mkdir()
    good = out / "hs_0.safetensors"
    _write_safetensors(good, {"token_ids": ("I64", [5]), "hidden_states": ("BF16", [5, 4, 16])})
    with AgentClient(agent_daemon.socket) as c:
        report = c.result("check", path=str(good), layers=4, hidden_size=16)
        assert report["ok"] is True and report["problems"] == []
        bad = c.result("check", path=str(good), layers=3, hidden_size=16)
        assert bad["ok"] is False and bad["problems"][0]["code"] == "layer_count_mismatch"
        assert c.request("check", path=str(tmp_path / "missing"))["code"] == "not_found"
        _write_safetensors(
            out / "hs_2.safetensors", {"token_ids": ("I64", [3]), "hidden_states": ("BF16", [3, 4, 16])}
        )
        argv = printer(tmp_path, ["working"], end_sleep=5)
        c.result(
            "launch",
            run="cap",
            spec=_cmd(argv, output_dir=str(out), expect={"layers": 4, "hidden_size": 16}, resume=True),
        )  # the files already there are this run's to carry on
        c.result("follow", run="cap", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=40))
    passed = [e for e in events if e.get("kind") == "shape_check_passed"]
    assert sorted(p["fields"]["file"] for p in passed) == ["hs_0.safetensors", "hs_2.safetensors"]
    gaps = [e for e in events if e.get("kind") == "shape_check_failed"]
    assert [g["fields"]["code"] for g in gaps] == ["index_gap"]  # hs_1 is missing: found at the end
    assert events[-1]["state"] == "completed"  # policy "alert": problems alert, they do not fail the run


def test_shutdown_leaves_jobs_running(agent_daemon: AgentProc, tmp_path: Path) -> None:
    with AgentClient(agent_daemon.socket) as c:
        res = c.result("launch", run="keep", spec=_cmd(sleeper(tmp_path, seconds=60)))
        assert c.result("shutdown") == {"stopping": True}
    assert agent_daemon.proc.wait(10) == 0
    from agent.jobs import procfs

    assert procfs.is_same_process(res["pid"], None, None)
    assert not agent_daemon.socket.exists()
    assert read_json(run_paths(agent_daemon.state_dir, "keep").exit) is None


def test_version_and_gpus(agent_daemon: AgentProc) -> None:
    with AgentClient(agent_daemon.socket) as c:
        v = c.result("version")
        assert v["agent_version"] == "0.1.0" and v["protocol"] == 1 and v["python"] == sys.version.split()[0]
        g = c.result("gpus")
        assert g["gpus"] == [] and g["processes"] == []  # no GPU here
    with AgentClient(agent_daemon.socket) as c, pytest.raises(AgentError, match="not_found"):
        c.result("status", run="x")


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    import json

    size = {"I64": 8, "BF16": 2, "F32": 4}
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data = bytearray(offset)
    for i in range(0, offset, 2):
        data[i] = 0x3F  # non-zero, finite values
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))


def test_huge_and_invalid_utf8_lines_are_capped_and_delivered(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    argv = write_script(
        tmp_path,
        "messy",
        """
        import sys
        out = sys.stdout.buffer
        out.write(b"before\\n")
        out.write(b"x" * (10 << 20) + b"\\n")  # one 10 MB line
        out.write(b"bad \\xff\\xfe utf-8\\n")
        out.write(b"\\x1b[32mgreen\\x1b[0m after\\n")
        out.flush()
    """,
    )
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="messy", spec=_cmd(argv))
        c.result("follow", run="messy", after_seq=0, log_offset=0)
        msgs = c.wait_for(terminal_event, timeout=60)
        if not any(t == "green after" for _, t in _log_lines(msgs)):
            msgs += c.wait_for(lambda m: last_log_text(m) == "green after", 20)
    got = _log_lines(msgs)
    assert [o for o, _ in got] == [0, 7, 7 + (10 << 20) + 1, 7 + (10 << 20) + 1 + 13]
    assert got[0][1] == "before"
    assert len(got[1][1]) < 70_000 and got[1][1].startswith("xxxx")  # capped, with a marker
    assert got[2][1] == "bad \ufffd\ufffd utf-8"
    assert got[3][1] == "green after"  # ANSI colour stripped
    assert _events(msgs)[-1]["state"] == "completed"


def test_socket_is_private(agent_daemon: AgentProc) -> None:
    assert agent_daemon.socket.stat().st_mode & 0o077 == 0
    assert agent_daemon.state_dir.joinpath("runs").stat().st_mode & 0o077 == 0


VLLM_LOG = str(Path(__file__).resolve().parents[1] / "helpers" / "vllm_log.py")


def test_realistic_tp2_vllm_run_completes_with_deduped_milestones(agent_daemon: AgentProc) -> None:
    argv = [sys.executable, VLLM_LOG, "--tp", "2", "--delay", "0.002"]
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="tp2", spec=_cmd(argv))
        c.result("follow", run="tp2", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=60))
    kinds = [e.get("kind") for e in events if e["type"] == "milestone"]
    weights = [
        e for e in events if e.get("kind") == "weights_loaded" and e["fields"]["rule"] == "weights_time"
    ]
    assert len(weights) == 1 and weights[0]["fields"]["ranks"] == [0, 1]  # both ranks print it: one milestone
    assert {"launched", "capture_configured", "progress", "completed"} <= set(kinds)
    assert events[-1]["state"] == "completed"


@pytest.mark.parametrize(
    ("failure", "exit_code", "words"),
    [
        ("oom", 1, ["exit code 1", "oom"]),
        ("nccl", 0, ["exited 0 after a fatal error", "nccl"]),  # NCCL failures that exit 0 are still failures
        ("worker_died", 0, ["worker_died"]),
    ],
)
def test_realistic_failures_fail_the_run(
    agent_daemon: AgentProc, failure: str, exit_code: int, words: list[str]
) -> None:
    argv = [sys.executable, VLLM_LOG, "--tp", "2", "--failure", failure, "--exit-code", str(exit_code)]
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run=f"f-{failure}", spec=_cmd(argv))
        c.result("follow", run=f"f-{failure}", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=60))
    errors = [e for e in events if e.get("kind") == "error"]
    assert failure in {e["fields"]["class"] for e in errors}
    assert events[-1]["state"] == "failed"
    for word in words:
        assert word in events[-1]["reason"]
    assert [e["kind"] for e in events if e.get("kind") == "failed"] == ["failed"]


@pytest.mark.slow
def test_locked_file_is_checked_only_after_its_lock_goes(agent_daemon: AgentProc, tmp_path: Path) -> None:
    out = tmp_path / "locked"
    out.mkdir()
    unlocked_at = tmp_path / "unlocked_at"
    argv = write_script(
        tmp_path,
        "locker",
        f"""
        import os, time
        out = {str(out)!r}
        open(os.path.join(out, "hs_0.safetensors.lock"), "w").close()
        open(os.path.join(out, "hs_0.safetensors"), "wb").write(b"xx")  # incomplete while locked
        time.sleep(5)
        t = time.time()
        os.remove(os.path.join(out, "hs_0.safetensors.lock"))
        open({str(unlocked_at)!r}, "w").write(str(t))
        time.sleep(6)
    """,
    )
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="lock", spec=_cmd(argv, output_dir=str(out)))
        c.result("follow", run="lock", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=40))
    checks = [e for e in events if e["type"] == "check"]
    assert len(checks) == 1 and checks[0]["problems"][0]["code"] == "unreadable"
    assert checks[0]["ts"] >= float(unlocked_at.read_text()) - 0.01
    assert events[-1]["state"] == "completed"


def test_processes_outliving_the_job_raise_a_warning(agent_daemon: AgentProc, tmp_path: Path) -> None:
    pidfile = tmp_path / "left.pid"
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="left", spec=_cmd(forker(tmp_path, pidfile, parent_exits=True)))
        c.result("follow", run="left", after_seq=0)
        events = _events(c.wait_for(terminal_event))
        warnings = [e for e in events if e.get("kind") == "warning"]
        assert events[-1]["state"] == "completed"
        assert [w["fields"]["rule"] for w in warnings] == ["leftover_processes"]
        assert [p["pid"] for p in warnings[0]["fields"]["processes"]] == [int(pidfile.read_text())]
        res = c.result("stop", run="left", grace_s=0.2)  # stop still cleans up after an ended run
        assert [k["pid"] for k in res["killed"]] == [int(pidfile.read_text())] and res["confirmed"] is True
        assert c.result("status", run="left")["state"] == "completed"


def test_extract_backend_runs_the_agents_own_extract_job(agent_daemon: AgentProc, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 32}))
    (tmp_path / "d.jsonl").write_text("{}\n")
    spec = {
        "name": "x",
        "host": "h",
        "backend": "worker-extension",
        "model": str(model),
        "dataset": str(tmp_path / "d.jsonl"),
        "output_dir": str(tmp_path / "out"),
        "expect": {"hidden_size": 1},  # no model has it: the job's own preflight refuses the spec
    }
    with AgentClient(agent_daemon.socket) as c:
        launched = c.result("launch", run="ext", spec=spec)
        spec_file = run_paths(agent_daemon.state_dir, "ext").spec
        assert launched["argv"] == [sys.executable, "-m", "agent", "extract", "--spec", str(spec_file)]
        assert read_json(spec_file) == spec  # written before the job started
        c.result("follow", run="ext", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=60))
    failed = [e for e in events if e.get("kind") == "failed"]
    reason = "expect.hidden_size 1 != model hidden_size 32"
    assert len(failed) == 1 and reason in failed[0]["fields"]["reason"]  # the job's own failed marker
    assert events[-1]["state"] == "failed" and "exit code 2" in events[-1]["reason"]
    assert f"job reported: {reason}" in events[-1]["reason"]


def test_a_launch_with_unusable_paths_is_refused_naming_the_field(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    spec = {"name": "x", "host": "h", "model": str(model), "dataset": str(tmp_path / "d.jsonl"),
            "output_dir": str(tmp_path / "out")}  # fmt: skip
    with AgentClient(agent_daemon.socket) as c:
        refused = c.request("launch", run="ext", spec=spec)
        assert refused["code"] == "bad_args" and refused["message"].startswith("spec.model: "), refused
        assert "has no config.json" in refused["message"]
        forecast = c.request("forecast", spec={**spec, "dataset": str(tmp_path / "none.jsonl")})
        assert forecast["code"] == "bad_args" and forecast["message"].startswith("spec.model: "), forecast
    assert not run_paths(agent_daemon.state_dir, "ext").dir.exists()


def test_ranks_printing_seconds_apart_still_make_one_milestone(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    """On a real GPU host TP ranks print the same line seconds apart (4 s here, other lines between)."""
    rank = (
        "(Worker_TP{r} pid=10{r}) INFO 11-30 09:53:00 [gpu_model_runner.py:5347] "
        "Model loading took 7.48 GiB memory and 1.{r} seconds"
    )
    argv = write_script(
        tmp_path,
        "slow_ranks",
        f"""
        import time
        for r in (0, 1):  # how the engine learns the world of a command job, as vLLM says it
            print(f"(Worker_TP{{r}} pid=10{{r}}) INFO 11-30 09:52:58 [parallel_state.py:1400] world_size=2 "
                  f"rank={{r}} local_rank={{r}} distributed_init_method=tcp://h:1 backend=nccl", flush=True)
        print({rank.format(r=0)!r}, flush=True)
        for i in range(20):  # the engine core keeps talking meanwhile: the log is never idle
            print(f"(EngineCore pid=99) INFO 11-30 09:53:01 [core.py:1] step {{i}}", flush=True)
            time.sleep(0.2)
        print({rank.format(r=1)!r}, flush=True)
        time.sleep(0.5)
    """,
    )
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="slow-ranks", spec=_cmd(argv, tensor_parallel_size=2))
        c.result("follow", run="slow-ranks", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=60))
    loaded = [e for e in events if e.get("kind") == "weights_loaded"]
    assert len(loaded) == 1 and loaded[0]["fields"]["ranks"] == [0, 1], loaded
