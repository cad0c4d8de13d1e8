"""Backend ``specforge`` through the real daemon: real torchrun, a stand-in for prepare_hidden_states.py.

SpecForge runs its target model in SGLang on GPUs, which cannot run here. The stand-in script in its place
prints the lines SpecForge prints (tests/fixtures/specforge-prepare-hidden-states.log, built from
scripts/prepare_hidden_states.py and specforge/utils.py) and writes files in SpecForge's documented layout:
``rows_{k}-{k+2000}/data_{i}.ckpt[.gz]`` holding ``input_ids``, ``loss_mask``, ``hidden_state`` [1, T, H]
and ``aux_hidden_state`` [1, T, 3·H] (torch.save). torchrun itself, the agent and its checker are real.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.milestones.engine import MilestoneEngine, load_rules
from agent.spec import parse_spec
from tests.helpers.agentproc import AgentClient, AgentError, AgentProc, agent_daemon, terminal_event

__all__ = ["agent_daemon"]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "specforge-prepare-hidden-states.log"
HIDDEN = 16

STANDIN = """
import argparse, gzip, os, sys, torch
p = argparse.ArgumentParser()
for flag in ("--target-model-path", "--data-path", "--output-path", "--tp-size", "--max-length",
             "--batch-size", "--num-samples", "--chat-template"):
    p.add_argument(flag)
args = p.parse_args()
assert os.environ["LOCAL_RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"  # started by torchrun
group = os.path.join(args.output_path, "rows_0-2000")
os.makedirs(group, exist_ok=True)
H = 16
def sample(t, aux_width):
    return {"input_ids": torch.arange(t), "loss_mask": torch.ones(t, dtype=torch.long),
            "hidden_state": torch.randn(1, t, H), "aux_hidden_state": torch.randn(1, t, aux_width)}
torch.save(sample(5, 3 * H), os.path.join(group, "data_0.ckpt"))
torch.save(sample(7, 3 * H), os.path.join(group, "data_1.ckpt"))
torch.save(sample(6, 2 * H), os.path.join(group, "data_2.ckpt"))  # one auxiliary layer short
with gzip.open(os.path.join(group, "data_4.ckpt.gz"), "wb") as f:  # data_3: skipped for NaN
    torch.save(sample(4, 3 * H), f)
sys.stdout.write(open(os.environ["SPECFORGE_LOG"]).read())
"""


def _ms(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("type") == "milestone" and e.get("kind") == kind]


@pytest.mark.slow
def test_specforge_run_is_launched_watched_and_its_files_checked(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    scripts = tmp_path / "SpecForge" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "prepare_hidden_states.py").write_text(STANDIN)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": HIDDEN}))
    (tmp_path / "sharegpt.jsonl").write_text('{"conversations": []}\n')  # the stand-in reads no row
    out = tmp_path / "hs"
    spec = {
        "name": "sf",
        "host": "local",
        "backend": "specforge",
        "model": str(model),
        "dataset": str(tmp_path / "sharegpt.jsonl"),
        "output_dir": str(out),
        "max_samples": 6,
        "batch_size": 2,
        "env": {"SPECFORGE_LOG": str(FIXTURE), "OMP_NUM_THREADS": "1"},
        "specforge": {
            "scripts_dir": str(scripts),
            "python": sys.executable,
            "args": ["--chat-template", "llama3"],
        },
    }
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="sf", spec=spec)
        c.result("follow", run="sf", after_seq=0)
        got = c.wait_for(lambda m: terminal_event(m) and m["run"] == "sf", timeout=120)
    events = [m["event"] for m in got if m.get("type") == "event" and m.get("run") == "sf"]
    assert events[-1]["state"] == "completed", events[-4:]
    (launched,) = _ms(events, "launched")
    assert launched["fields"]["argv"][-3:] == ["extract", "--spec", launched["fields"]["argv"][-1]]
    (plan,) = _ms(events, "capture_configured")
    assert plan["fields"]["layers"] == [1, 15, 28] and plan["fields"]["method"] == "eagle3"
    (nan,) = [w for w in _ms(events, "warning") if w["fields"].get("rule") == "specforge_nan_skipped"]
    assert (
        nan["fields"]["file"] == "/data/hs/rows_0-2000/data_3.ckpt" and nan["fields"]["code"] == "non_finite"
    )
    bars = [p["fields"] for p in _ms(events, "progress") if p["fields"].get("rule") == "specforge_bar"]
    assert bars[-1]["samples_done"] == 6 and bars[-1]["batches_done"] == bars[-1]["batches_total"] == 3
    (done,) = _ms(events, "completed")
    assert done["fields"]["samples"] == 6
    passed = sorted(m["fields"]["file"] for m in _ms(events, "shape_check_passed"))
    assert passed == ["rows_0-2000/data_0.ckpt", "rows_0-2000/data_1.ckpt", "rows_0-2000/data_4.ckpt.gz"]
    failed = {m["fields"]["code"]: m["fields"] for m in _ms(events, "shape_check_failed")}
    assert set(failed) == {"layer_count_mismatch", "index_gap"}
    assert failed["layer_count_mismatch"]["file"] == str(out / "rows_0-2000" / "data_2.ckpt")
    assert "2 layers (32 = 2 × 16), expected 3" in failed["layer_count_mismatch"]["message"]
    assert failed["index_gap"]["message"].endswith("data_0.ckpt … data_4.ckpt: data_3")


FAILING = """
import os
assert os.environ["LOCAL_RANK"] == "0"  # started by torchrun
print("rank 0: Dataset prepared with 2 samples", flush=True)
def load_target(path):
    raise ValueError(f"stand-in: no tokenizer in {path}")
load_target("/models/target")
"""


def _specforge_spec(tmp_path: Path, scripts: Path, name: str) -> dict[str, Any]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": HIDDEN}))
    (tmp_path / "data.jsonl").write_text('{"conversations": []}\n' * 2)
    return {"name": name, "host": "local", "backend": "specforge", "model": str(model),
            "dataset": str(tmp_path / "data.jsonl"), "output_dir": str(tmp_path / "hs"),
            "env": {"OMP_NUM_THREADS": "1"},
            "specforge": {"scripts_dir": str(scripts), "python": sys.executable}}  # fmt: skip


@pytest.mark.slow
def test_a_failed_torchrun_child_is_the_reason_not_childfailederror(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    """The child's exception, not torchrun's ChildFailedError summary after it, is the failure reason."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "prepare_hidden_states.py").write_text(FAILING)
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="sffail", spec=_specforge_spec(tmp_path, scripts, "sffail"))
        c.result("follow", run="sffail", after_seq=0)
        got = c.wait_for(lambda m: terminal_event(m) and m["run"] == "sffail", timeout=120)
    events = [m["event"] for m in got if m.get("type") == "event" and m.get("run") == "sffail"]
    end = events[-1]
    assert end["state"] == "failed", events[-4:]
    error = end["reason"].split("; error: ", 1)[1]
    assert error.startswith("ValueError: stand-in: no tokenizer in /models/target"), end["reason"]
    (wrapper,) = [e for e in _ms(events, "error") if "ChildFailedError" in e["text"]]
    assert wrapper["fields"]["root_cause"] == "ValueError: stand-in: no tokenizer in /models/target"


@pytest.mark.parametrize("child", ["missing", "killed"])
def test_torchrun_ends_named_by_the_worker_not_childfailederror(tmp_path: Path, child: str) -> None:
    """Real torchrun of a script that is not there (Python's "can't open file" line is the cause) and of one
    killed by SIGKILL as the kernel's OOM killer does (torchrun's exit line for that worker is the cause)."""
    import subprocess

    from agent.milestones.cli import scan
    from agent.runs.summary import RunSummary, final_state

    script = tmp_path / "SpecForge" / "scripts" / "prepare_hidden_states.py"
    if child == "killed":
        script.parent.mkdir(parents=True)
        script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    log = tmp_path / "output.log"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    with log.open("wb") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        code = subprocess.run(
            [*torchrun, str(script)], stdout=out, stderr=subprocess.STDOUT, env=env
        ).returncode
    assert "ChildFailedError" in log.read_text()
    events = [{"type": "milestone", **m.to_dict()} for m in scan(log, load_rules())]
    state, reason = final_state({"code": code}, None, RunSummary.from_events(events), "specforge")
    error, last = reason.split("; error: ", 1)[1].split("; last error: ")
    assert state == "failed" and "ChildFailedError" in last and "ChildFailedError" not in error, reason
    if child == "missing":
        assert error.startswith(f"import: {sys.executable}: can't open file '{script}': [Errno 2]"), reason
    else:
        assert error.startswith("worker_died: failed (exitcode: -9) local_rank: 0 (pid: "), reason


@pytest.mark.slow
@pytest.mark.parametrize("lacks", ["dir", "script"])
def test_a_scripts_dir_that_cannot_run_is_refused_naming_its_path(
    agent_daemon: AgentProc, tmp_path: Path, lacks: str
) -> None:
    scripts = tmp_path / "scripts"
    if lacks == "script":
        scripts.mkdir()
        (scripts / "prepare_data.py").touch()
    with AgentClient(agent_daemon.socket) as c, pytest.raises(AgentError) as err:
        c.result("launch", run="sfpath", spec=_specforge_spec(tmp_path, scripts, "sfpath"))
    why = "does not exist on this host" if lacks == "dir" else "has no prepare_hidden_states.py"
    assert str(err.value) == f"bad_args: spec.specforge.scripts_dir: scripts_dir {scripts} {why}"
    assert not (agent_daemon.state_dir / "runs" / "sfpath").exists()


def test_specforge_log_lines_become_milestones() -> None:
    engine = MilestoneEngine(load_rules())
    found = []
    for n, line in enumerate(FIXTURE.read_text().splitlines(), 1):
        found += engine.feed(line, n)
    found += engine.flush()
    kinds = [(m.kind, m.fields.get("rule")) for m in found]
    assert kinds[0] == ("capture_configured", "specforge_capture_plan")  # once, though every rank prints it
    assert ("progress", "specforge_dataset") in kinds and ("completed", "specforge_finished") in kinds
    assert [m.fields["tp_rank"] for m in found if m.fields.get("rule") == "specforge_parallel"] == [0, 1]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"specforge": None}, "backend 'specforge' needs specforge"),
        ({"layers": [1, 2, 3]}, "takes its layers from its draft model config"),
        ({"specforge": {"scripts_dir": "SpecForge/scripts"}}, "must be an absolute path on the host"),
        ({"specforge": {"scripts_dir": "/s", "args": ["--tp-size 2"]}}, "specforge.args item '--tp-size 2'"),
        ({"shard": {"index": 0, "count": 2}}, "splits work with its own flags"),
        ({"speculators": {}}, "'speculators' is only allowed with backend 'speculators'"),
    ],
)
def test_bad_specforge_specs_are_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    from pydantic import ValidationError

    spec = {"host": "h", "backend": "specforge", "model": "/m", "dataset": "/d", "output_dir": "/o",
            "specforge": {"scripts_dir": "/s"}, **change}  # fmt: skip
    with pytest.raises(ValidationError) as err:
        parse_spec({k: v for k, v in spec.items() if v is not None})
    assert message in str(err.value)


def test_a_specforge_output_dir_can_be_resumed_into(tmp_path: Path) -> None:
    from agent.runs.outdir import foreign_files

    (tmp_path / "rows_0-2000").mkdir()
    (tmp_path / "vocab_mapping").mkdir()
    (tmp_path / "rows_0-2000" / "data_0.ckpt").write_bytes(b"x")
    assert foreign_files(str(tmp_path)) == []
    (tmp_path / "notes.txt").write_text("mine")
    assert foreign_files(str(tmp_path)) == ["notes.txt"]


def test_check_of_a_specforge_dir_expects_eagle3_aux_width_without_being_told(tmp_path: Path) -> None:
    """`eaglewatch-agent check DIR` with no --layers: aux_hidden_state must be 3 × hidden (EAGLE-3)."""
    import gzip
    import io
    import subprocess

    import torch

    group = tmp_path / "rows_0-2000"
    group.mkdir()

    def sample(t: int, aux: int) -> dict[str, Any]:
        return {
            "input_ids": torch.arange(t),
            "loss_mask": torch.ones(t, dtype=torch.long),
            "hidden_state": torch.randn(1, t, HIDDEN),
            "aux_hidden_state": torch.randn(1, t, aux * HIDDEN),
        }

    torch.save(sample(5, 3), group / "data_0.ckpt")
    torch.save(sample(5, 2), group / "data_1.ckpt")
    buf = io.BytesIO()
    torch.save(sample(4, 3), buf)
    (group / "data_2.ckpt.gz").write_bytes(gzip.compress(buf.getvalue()))
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "check", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["files"] == 3 and report["format"] == "specforge-ckpt"
    (problem,) = report["problems"]
    assert problem["code"] == "layer_count_mismatch" and problem["file"].endswith("rows_0-2000/data_1.ckpt")
    assert "expected 3 (+ hidden_state as layer 4)" in problem["message"]


SLEEPER = """
import json, os, sys, time
open(os.environ["STANDIN_PID"], "w").write(json.dumps(os.getpid()))
print("rank 0: Dataset prepared with 2 samples", flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_stop_ends_torchrun_and_its_worker(agent_daemon: AgentProc, tmp_path: Path) -> None:
    """torchrun runs as the job's child in its process group: the agent's stop ends it and its worker."""
    import os
    import time

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "prepare_hidden_states.py").write_text(SLEEPER)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": HIDDEN}))
    (tmp_path / "data.jsonl").write_text('{"conversations": []}\n' * 2)
    pid_file = tmp_path / "worker.pid"
    spec = {"name": "sfstop", "host": "local", "backend": "specforge", "model": str(model),
            "dataset": str(tmp_path / "data.jsonl"), "output_dir": str(tmp_path / "hs"),
            "env": {"STANDIN_PID": str(pid_file), "OMP_NUM_THREADS": "1"},
            "specforge": {"scripts_dir": str(scripts), "python": sys.executable}}  # fmt: skip
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="sfstop", spec=spec)
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        worker = json.loads(pid_file.read_text())
        assert c.result("stop", run="sfstop")["confirmed"] is True
        c.result("follow", run="sfstop", after_seq=0)
        got = c.wait_for(lambda m: terminal_event(m) and m["run"] == "sfstop", timeout=60)
    events = [m["event"] for m in got if m.get("type") == "event" and m.get("run") == "sfstop"]
    assert events[-1]["state"] == "stopped"
    totals = [p["fields"] for p in _ms(events, "progress") if p["fields"].get("rule") == "pipeline_total"]
    assert totals and totals[0]["samples_total"] == 2
    try:
        os.kill(worker, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"torchrun's worker {worker} is still running")
