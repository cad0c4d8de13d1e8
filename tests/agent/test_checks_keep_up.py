"""Checks keep up with a job that writes capture files fast: all checked within seconds, verdict last."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from agent.paths import read_json, run_paths
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon, terminal_event

__all__ = ["agent_daemon"]

pytestmark = pytest.mark.timeout(120)

FILES = 1500

#: A job that writes FILES small real safetensors files (4 layers × 16 wide, bf16 ones) but hs_1000, and
#: exits; hs_7 holds an all-zero layer, so the value scan (a child's work) must run on every file.
WRITER = """
import json, os, struct, sys
out, n = sys.argv[1], int(sys.argv[2])
tokens = 3
ids = struct.pack("<3q", 1, 2, 3)
ones = struct.pack("<H", 0x3F80) * (tokens * 4 * 16)
zero_layer = (struct.pack("<H", 0x3F80) * (16 * 3) + bytes(16 * 2)) * tokens
def blob(hs):
    header = {
        "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [0, len(ids)]},
        "hidden_states": {
            "dtype": "BF16", "shape": [tokens, 4, 16], "data_offsets": [len(ids), len(ids) + len(hs)]
        },
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + ids + hs
for i in (i for i in range(n) if i != 1000):
    tmp = os.path.join(out, f".hs_{i}.tmp")
    with open(tmp, "wb") as f:
        f.write(blob(zero_layer if i == 7 else ones))
    os.rename(tmp, os.path.join(out, f"hs_{i}.safetensors"))
print("wrote", n, flush=True)
"""


def _events(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["event"] for m in msgs if m.get("type") == "event"]


def test_every_file_is_checked_within_seconds_and_the_verdict_comes_last(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    out = tmp_path / "cap"
    out.mkdir()
    spec = {
        "name": "many",
        "host": "local",
        "backend": "command",
        "command": [sys.executable, str(script), str(out), str(FILES)],
        "output_dir": str(out),
        "expect": {"layers": 4, "hidden_size": 16},
    }
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="many", spec=spec)
        c.result("follow", run="many", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=90))
    ended_at = read_json(run_paths(agent_daemon.state_dir, "many").exit)["ended_at"]
    checks = [e for e in events if e["type"] == "check"]
    written = sorted(f"hs_{i}.safetensors" for i in range(FILES) if i != 1000)
    assert sorted(e["file"] for e in checks) == sorted([*written, "."])  # ".": the index gaps
    failed = [e for e in events if e.get("kind") == "shape_check_failed"]
    assert sorted((f["fields"]["file"], f["fields"]["code"]) for f in failed) == [
        (str(out), "index_gap"),
        (str(out / "hs_7.safetensors"), "all_zero"),
    ]
    assert sum(e.get("kind") == "shape_check_passed" for e in events) == FILES - 2
    final = events[-1]
    assert final["type"] == "state" and final["state"] == "completed"
    assert max(e["seq"] for e in checks) < final["seq"]  # the verdict waits for the last check
    assert final["ts"] - ended_at < 5.0, "the verdict came more than 5 s after the job's exit"
