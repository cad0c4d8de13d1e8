"""Shards of one run sharing an output dir through the real daemon: both launch, each checks only its files.

A printer script stands in for each shard's extraction job; the shard manifests and capture files it
would write are put in place before the launch (the daemon reads a shard's range from its manifest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.agent.test_daemon import _write_safetensors
from tests.helpers.agentjobs import printer
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon, terminal_event

__all__ = ["agent_daemon"]


def _shard_spec(argv: list[str], out: Path, index: int, count: int) -> dict[str, Any]:
    return {
        "name": "s",
        "host": "local",
        "backend": "command",
        "command": argv,
        "output_dir": str(out),
        "expect": {"layers": 4, "hidden_size": 16},
        "shard": {"index": index, "count": count},
    }


def _capture(out: Path, idx: int) -> None:
    _write_safetensors(
        out / f"hs_{idx}.safetensors", {"token_ids": ("I64", [3]), "hidden_states": ("BF16", [3, 4, 16])}
    )


def test_two_shards_share_an_output_dir_and_check_only_their_own_files(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for index, (start, end) in enumerate([(0, 3), (3, 6)]):
        shard = {"index": index, "count": 2, "start": start, "end": end}
        (out / f"manifest.shard-{index}-of-2.json").write_text(json.dumps({"shard": shard}))
    for idx in (0, 2, 3, 4, 5):  # shard 0 lost hs_1
        _capture(out, idx)
    (out / "layer_stats.jsonl").write_text('{"idx":0,"layers":{}}\n')  # the jobs append their statistics
    argv = printer(tmp_path, ["working"], end_sleep=4)
    events: dict[str, list[dict[str, Any]]] = {}
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="s0", spec=_shard_spec(argv, out, 0, 2))
        c.result("launch", run="s1", spec=_shard_spec(argv, out, 1, 2))
        again = c.request("launch", run="s0b", spec=_shard_spec(argv, out, 0, 2))
        assert again["code"] == "bad_args" and "overlaps the output directory of run 's0'" in again["message"]
        bad = c.request("launch", run="s2", spec=_shard_spec(argv, out, 2, 2))
        assert bad["code"] == "bad_args" and "spec.shard" in bad["message"]
        for run in ("s0", "s1"):
            c.result("follow", run=run, after_seq=0)
            got = c.wait_for(lambda m, r=run: terminal_event(m) and m["run"] == r, timeout=40)
            events[run] = [m["event"] for m in got if m.get("type") == "event" and m.get("run") == run]
    for run, files in (
        ("s0", ["hs_0.safetensors", "hs_2.safetensors"]),
        ("s1", [f"hs_{i}.safetensors" for i in (3, 4, 5)]),
    ):
        evs = events[run]
        assert evs[-1]["state"] == "completed"
        passed = sorted(e["fields"]["file"] for e in evs if e.get("kind") == "shape_check_passed")
        assert passed == files, run
    gaps = [e["fields"]["message"] for e in events["s0"] if e.get("kind") == "shape_check_failed"]
    assert len(gaps) == 1 and gaps[0].endswith(": hs_1")  # inside shard 0's range only
    assert not [e for e in events["s1"] if e.get("kind") == "shape_check_failed"]
