"""output_dir: refused as '/', with '..', inside the state dir, another active run's dir, or full of foreign
files (the spec, JobSpec and the daemon's launch say it alike); the checker does not follow links out."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agent.checks.checker import check_path
from agent.paths import run_paths
from agent.runs.jobspec import JobSpec, SpecError
from agent.spec import parse_spec
from tests.helpers.agentjobs import sleeper
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon

__all__ = ["agent_daemon"]

SECRET = b"root:$6$SECRETHASHBYTES$::0:99999:7:::\n"


def _cmd(argv: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": "t", "host": "local", "backend": "command", "command": argv, **extra}


def _ext(out: str) -> dict[str, Any]:
    return {"host": "h", "model": "/m", "dataset": "/d.jsonl", "output_dir": out}


@pytest.mark.parametrize(
    ("out", "words"),
    [
        ("/", "root directory"),
        ("//", "root directory"),
        ("/./", "root directory"),
        ("/data/../etc", "'..'"),
        ("/data/run/..", "'..'"),
        ("relative/dir", "absolute"),
    ],
)
def test_spec_and_jobspec_refuse_the_same_output_dirs(out: str, words: str) -> None:
    with pytest.raises(ValidationError) as bad:
        parse_spec(_ext(out))
    with pytest.raises(SpecError) as view:
        JobSpec.parse(_ext(out))
    assert words in str(view.value) and "spec.output_dir" in str(view.value)
    message = str(view.value).removeprefix("spec.")
    assert message in str(bad.value)  # one message, whichever side refuses


def test_plain_output_dirs_are_accepted() -> None:
    assert parse_spec(_ext("/data/hs/run-1")).output_dir == "/data/hs/run-1"
    assert JobSpec.parse(_ext("/data/hs/run-1")).output_dir == "/data/hs/run-1"


def test_launch_refuses_output_dirs_it_must_not_write(agent_daemon: AgentProc, tmp_path: Path) -> None:
    argv = sleeper(tmp_path, seconds=30)
    busy = tmp_path / "busy"
    busy.mkdir()
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine")
    (foreign / "hs_0.safetensors").write_bytes(b"x")
    state = agent_daemon.state_dir
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="busy", spec=_cmd(argv, output_dir=str(busy)))
        cases: list[tuple[str, str]] = [
            ("/", "root directory"),
            (str(tmp_path / "x" / ".." / "busy"), "'..'"),
            (str(state), "state directory"),
            (str(state / "runs" / "busy"), "state directory"),
            (str(tmp_path), "state directory"),  # holds the state dir
            (str(busy), "run 'busy'"),
            (str(busy / "sub"), "run 'busy'"),
            (str(foreign), "'thesis.tex'"),
            (str(argv[-1]), "not a directory"),
        ]
        for i, (out, words) in enumerate(cases):
            msg = c.request("launch", run=f"r{i}", spec=_cmd(argv, output_dir=out))
            assert msg["type"] == "error" and msg["code"] == "bad_args", (out, msg)
            assert "spec.output_dir" in msg["message"] and words in msg["message"], (out, msg)
            assert not run_paths(state, f"r{i}").dir.exists()


def test_launch_accepts_new_empty_and_resumed_output_dirs(agent_daemon: AgentProc, tmp_path: Path) -> None:
    argv = sleeper(tmp_path, seconds=30)
    resumed = tmp_path / "resumed"
    (resumed / ".staging-abc").mkdir(parents=True)
    for name in ("hs_0.safetensors", "hs_1.safetensors.lock", "manifest.json", "manifest.shard-0-of-2.json"):
        (resumed / name).write_bytes(b"{}")
    (tmp_path / "empty").mkdir()
    with AgentClient(agent_daemon.socket) as c:
        # files of a capture are carried on only by a spec that resumes
        refused = c.request("launch", run="again", spec=_cmd(argv, output_dir=str(resumed)))
        assert "already holds capture files" in refused["message"], refused
        for run, out in (("new", tmp_path / "new"), ("empty", tmp_path / "empty"), ("resumed", resumed)):
            spec = _cmd(argv, output_dir=str(out), resume=out == resumed)
            assert c.result("launch", run=run, spec=spec)["pid"] > 0


def test_checker_does_not_follow_a_link_out_of_the_output_dir(tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET)
    out = tmp_path / "out"
    out.mkdir()
    (out / "hs_0.safetensors").symlink_to(secret)
    (out / "sample_lengths.json").symlink_to(secret)
    for target in (out, out / "hs_0.safetensors"):
        report = check_path(target).to_dict()
        text = repr(report)
        assert "SECRETHASH" not in text and "root:" not in text, report
        problems = report["problems"]
        assert [p["file"] for p in problems] == [str(out / "hs_0.safetensors")]
        assert "symbolic link pointing outside" in problems[0]["message"]


def test_checker_still_reads_a_link_inside_the_output_dir(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "real").mkdir(parents=True)
    (out / "real" / "blob").write_bytes(b"\x01")
    os.symlink("real/blob", out / "hs_0.safetensors")
    problems = check_path(out).to_dict()["problems"]
    assert problems and "symbolic link" not in problems[0]["message"]  # read, and found truncated


def test_checker_does_not_walk_a_capture_name_linked_to_a_directory_elsewhere(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "hs_0.safetensors").write_bytes(SECRET)
    out = tmp_path / "out"
    out.mkdir()
    (out / "hs_1.safetensors").symlink_to(elsewhere)
    report = check_path(out / "hs_1.safetensors").to_dict()  # how the daemon checks each file of a run
    assert "SECRETHASH" not in repr(report) and report["files"] == 0
    assert [p["file"] for p in report["problems"]] == [str(out / "hs_1.safetensors")]
