"""Backend ``speculators`` as the README writes it: speculators 0.9.0's client against a real vLLM CPU server.

The spec is the README's speculators block, read out of README.md; only what names this machine changes
(host, model, dataset, output_dir and a free port). Everything else is the README's: tensor_parallel_size 2,
``--gpu-memory-utilization``, ``--world-size 2 --rank 0``, no env and no server_command. So the job itself
must find the CPU platform and give the server what it needs there: a server command the CPU build can
start, eaglewatch's CPU engine defaults (KV-cache space, thread binding for the 2 ranks, float32 where the
CPU lacks bf16, eager) and eaglewatch's CPU-capable connector. Real parts: the agent daemon launches the
job, which starts the vLLM (CPU build) server and, once it answers, ``python -m speculators
generate-offline-data``; the daemon follows the tagged log and checks each hs_N file. The daemon runs
offline (HF_HUB_OFFLINE in its environment, as on a host without network): the model is a local directory.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.verdict import CheckTally, verdict
from tests.helpers.agentproc import REPO, AgentClient, AgentProc, cleanup_runs, start_agent, terminal_event

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

SAMPLES = [[5, 17, 42], [6, 17, 43, 99], [7, 17, 44, 99, 7], [8, 17, 45]]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def readme_spec() -> dict[str, Any]:
    """The README's speculators spec block, parsed as written."""
    blocks = re.findall(r"```json\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), re.S)
    (block,) = [b for b in blocks if '"backend": "speculators"' in b]
    spec: dict[str, Any] = json.loads(block)
    return spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _milestones(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("type") == "milestone" and e.get("kind") == kind]


@pytest.fixture
def offline_daemon(tmp_path: Path) -> Iterator[AgentProc]:
    """A running daemon whose environment is offline; teardown kills it and every job it started."""
    state = tmp_path / "state"
    agent = start_agent(state, env=OFFLINE)
    try:
        yield agent
    finally:
        agent.kill()
        cleanup_runs(state)


def test_readme_speculators_spec_runs_unchanged_on_the_cpu_engine(
    offline_daemon: AgentProc, tiny_llama: Path, tmp_path: Path
) -> None:
    pytest.importorskip("speculators")
    from datasets import Dataset
    from safetensors.torch import load_file

    data = tmp_path / "data"
    Dataset.from_dict({"input_ids": SAMPLES}).with_format("torch").save_to_disk(str(data))
    out = tmp_path / "out"
    spec = readme_spec()
    here = {"host": "local", "model": str(tiny_llama), "dataset": str(data), "output_dir": str(out)}
    assert set(here) <= set(spec)  # the README still names each field this test points elsewhere
    spec.update(here)
    spec["speculators"]["port"] = _free_port()
    with AgentClient(offline_daemon.socket) as c:
        c.result("launch", run="sp", spec=spec)
        c.result("follow", run="sp", after_seq=0)
        got = c.wait_for(lambda m: terminal_event(m) and m["run"] == "sp", timeout=800)
    events = [m["event"] for m in got if m.get("type") == "event" and m.get("run") == "sp"]
    problems = [(e["kind"], e["fields"], e["text"]) for e in events if e.get("kind") in ("error", "failed")]
    assert events[-1]["state"] == "completed", problems
    # the job's own defaults for the server, reported before it starts: the CPU platform's
    (config,) = [m for m in _milestones(events, "engine_config") if m["fields"].get("source") == "eaglewatch"]
    fields = config["fields"]
    assert fields["platform"] == "cpu" and fields["process"] == "server"
    assert fields["defaults"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"  # TP=2 on this host's 2 CPUs
    assert int(fields["defaults"]["VLLM_CPU_KVCACHE_SPACE"]) >= 1
    assert "--enforce-eager" in fields["defaults"]["vllm_args"]
    assert fields["reasons"]["kv_connector"].startswith("EagleWatchHiddenStatesConnector")
    # both logs feed milestones, each tagged with its process
    ready = _milestones(events, "server_ready")
    assert ready and all(m["fields"]["process"] == "server" for m in ready)
    assert {m["fields"].get("rule") for m in ready} >= {"app_startup"}
    (done,) = _milestones(events, "completed")
    assert done["fields"] == {"rule": "speculators_complete", "process": "client"}
    # --world-size 2 --rank 0: this rank's half of the rows, as speculators splits them
    mine = SAMPLES[: len(SAMPLES) // 2]
    progress = [
        m["fields"] for m in _milestones(events, "progress") if m["fields"].get("process") == "client"
    ]
    assert any(p.get("rule") == "speculators_bar" and p["samples_done"] == len(mine) for p in progress)
    # the client started only once the server was ready: its first milestone follows the server's
    first_client = min(m["seq"] for m in events if m.get("fields", {}).get("process") == "client")
    assert min(m["seq"] for m in ready) < first_client
    # every file speculators wrote was checked by the agent and passed: verdict ok
    passed = sorted(m["fields"]["file"] for m in _milestones(events, "shape_check_passed"))
    failed = [m["fields"] for m in _milestones(events, "shape_check_failed")]
    assert passed == [f"hs_{i}.safetensors" for i in range(len(mine))] and not failed
    assert verdict(events[-1]["state"], CheckTally(checked=passed, bad=[], problems=len(failed))) == "ok"
    for i, ids in enumerate(mine):
        got_file = load_file(str(out / f"hs_{i}.safetensors"))
        assert got_file["token_ids"].tolist() == ids
        assert tuple(got_file["hidden_states"].shape) == (len(ids), 4, 128)
    # the job's forecast before launch is what speculators then wrote (its header bytes are rounded up)
    (forecast,) = _milestones(events, "forecast")
    actual = sum((out / f"hs_{i}.safetensors").stat().st_size for i in range(len(mine)))
    assert forecast["fields"]["estimated"] is False and forecast["fields"]["samples"] == len(mine)
    assert actual <= forecast["fields"]["bytes"] <= actual + 256 * len(mine), (actual, forecast)
    # and the job's disk progress counts those files, with the free space of the output dir
    disk = [
        m["fields"] for m in _milestones(events, "progress") if m["fields"].get("rule") == "pipeline_disk"
    ]
    assert disk and disk[-1]["files_written"] == len(mine) and disk[-1]["bytes_written"] == actual
    assert disk[-1]["free_bytes"] > 0 and disk[-1]["disk_low"] is False
