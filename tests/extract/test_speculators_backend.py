"""Backend ``speculators`` end to end: speculators 0.9.0's own client against a real vLLM CPU server.

Real parts: the agent daemon launches the job, which starts a vLLM (CPU build) server for
``extract_hidden_states`` and, once it answers, ``python -m speculators generate-offline-data
--validate-outputs``; the daemon follows the tagged log and checks each hs_N file. Two things differ from
a GPU host, both because of the CPU build: vLLM's default hidden-states connector cannot write on CPU
(pinned memory, CUDA streams), so the server gets eaglewatch's CPU-capable connector through vLLM's
``kv_connector_module_path`` (a later --kv_transfer_config in vllm_args wins); and the CPU build installs
no ``vllm`` distribution metadata, which ``vllm serve``'s CLI reads for --version, so the server starts
through ``vllm.entrypoints.openai.api_server`` (speculators.server_command).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import IN_PROCESS_ENGINE
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon, terminal_event

__all__ = ["agent_daemon"]

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

API_SERVER = "vllm.entrypoints.openai.api_server"
SAMPLES = [[5, 17, 42], [6, 17, 43, 99], [7, 17, 44, 99, 7], [8, 17, 45]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _milestones(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("type") == "milestone" and e.get("kind") == kind]


def test_speculators_client_and_vllm_server_run_and_are_watched(
    agent_daemon: AgentProc, tiny_llama: Path, tmp_path: Path
) -> None:
    pytest.importorskip("speculators")
    from datasets import Dataset
    from safetensors.torch import load_file

    model = tiny_llama
    data = tmp_path / "data"
    Dataset.from_dict({"input_ids": SAMPLES}).with_format("torch").save_to_disk(str(data))
    out = tmp_path / "out"
    transfer = {
        "kv_connector": "EagleWatchHiddenStatesConnector",
        "kv_connector_module_path": "agent.extract.engine.native_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "staging")},
    }
    spec = {
        "name": "spec09",
        "host": "local",
        "backend": "speculators",
        "model": str(model),
        "dataset": str(data),
        "output_dir": str(out),
        # the worker inside the server's engine core process (jobrun.IN_PROCESS_ENGINE): not the subject
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                **IN_PROCESS_ENGINE},
        "vllm_args": [
            "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--no-enable-prefix-caching",
            "--kv_transfer_config", json.dumps(transfer),
        ],
        "speculators": {
            "server_command": [sys.executable, "-m", API_SERVER, "--model", str(model)],
            "port": _free_port(),
            "ready_timeout_s": 600,
            "client_args": ["--validate-outputs", "--concurrency", "2"],
        },
    }  # fmt: skip
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="sp", spec=spec)
        c.result("follow", run="sp", after_seq=0)
        got = c.wait_for(lambda m: terminal_event(m) and m["run"] == "sp", timeout=800)
    events = [m["event"] for m in got if m.get("type") == "event" and m.get("run") == "sp"]
    problems = [(e["kind"], e["fields"], e["text"]) for e in events if e.get("kind") in ("error", "failed")]
    assert events[-1]["state"] == "completed", problems
    # both logs feed milestones, each tagged with its process
    ready = _milestones(events, "server_ready")
    assert ready and all(m["fields"]["process"] == "server" for m in ready)
    assert {m["fields"].get("rule") for m in ready} >= {"app_startup"}
    (done,) = _milestones(events, "completed")
    assert done["fields"] == {"rule": "speculators_complete", "process": "client"}
    progress = [
        m["fields"] for m in _milestones(events, "progress") if m["fields"].get("process") == "client"
    ]
    assert {
        "rule": "speculators_processing",
        "samples_total": 4,
        "samples_done": 0,
        "process": "client",
    } in progress
    assert any(p.get("rule") == "speculators_bar" and p["samples_done"] == 4 for p in progress)
    assert any(m["fields"]["process"] == "client" for m in _milestones(events, "throughput"))
    # the client started only once the server was ready: its first milestone follows the server's
    first_client = min(m["seq"] for m in events if m.get("fields", {}).get("process") == "client")
    assert min(m["seq"] for m in ready) < first_client
    # every file speculators wrote was checked by the agent and passed
    passed = sorted(m["fields"]["file"] for m in _milestones(events, "shape_check_passed"))
    assert passed == [f"hs_{i}.safetensors" for i in range(len(SAMPLES))]
    assert not _milestones(events, "shape_check_failed")
    for i, ids in enumerate(SAMPLES):
        got_file = load_file(str(out / f"hs_{i}.safetensors"))
        assert got_file["token_ids"].tolist() == ids
        assert tuple(got_file["hidden_states"].shape) == (len(ids), 4, 128)
    # the job's forecast before launch is what speculators then wrote (its header bytes are rounded up)
    (forecast,) = _milestones(events, "forecast")
    actual = sum((out / f"hs_{i}.safetensors").stat().st_size for i in range(len(SAMPLES)))
    assert forecast["fields"]["estimated"] is False and forecast["fields"]["samples"] == len(SAMPLES)
    assert actual <= forecast["fields"]["bytes"] <= actual + 256 * len(SAMPLES), (actual, forecast)
    # and the job's disk progress counts those files, with the free space of the output dir
    disk = [
        m["fields"] for m in _milestones(events, "progress") if m["fields"].get("rule") == "pipeline_disk"
    ]
    assert disk and disk[-1]["files_written"] == len(SAMPLES) and disk[-1]["bytes_written"] == actual
    assert disk[-1]["free_bytes"] > 0 and disk[-1]["disk_low"] is False
