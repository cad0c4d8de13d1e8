"""A capture file that is not a weights-only pickle is refused, never run: ``eaglewatch-agent check`` (a real
subprocess) loads .pt/.ckpt files with torch.load(weights_only=True) and reports what they ask for."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
T, H = 6, 8


class Runs:
    """Unpickling this runs a shell command: what a hostile file in an output dir would carry."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


class Custom:
    """An arbitrary class: a weights-only load must not import or build it."""


def modelopt(extra: object) -> dict[str, Any]:
    """A Model-Optimizer sample with one more value in it."""
    return {
        "input_ids": torch.arange(T),
        "hidden_states": torch.randn(T, H),
        "aux_hidden_states": torch.randn(T, 3 * H),
        "conversation_id": extra,
    }


def saved(obj: object) -> bytes:
    """torch.save's bytes of obj (its zip format)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_code_running_pickles_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    out = tmp_path / "dump"
    out.mkdir()
    touch = Runs(f"touch {marker}")
    (out / "conv-0.pt").write_bytes(saved(modelopt("conv-0")))
    (out / "conv-1.pt").write_bytes(saved(modelopt(touch)))
    (out / "conv-2.pt").write_bytes(saved(modelopt(Custom())))
    (out / "conv-3.pt").write_bytes(
        pickle.dumps({"input_ids": [0, 1], "x": touch}, protocol=2)
    )  # a plain pickle, not torch's zip
    (out / "data_0.ckpt.gz").write_bytes(gzip.compress(saved({"input_ids": torch.arange(T), "x": touch})))
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "check", str(out), "--hidden-size", str(H), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert not marker.exists(), "a capture file's pickle ran a command"
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["files"] == 5, proc.stderr
    got = {Path(p["file"]).name: p for p in report["problems"]}
    assert set(got) == {"conv-1.pt", "conv-2.pt", "conv-3.pt", "data_0.ckpt.gz"}, report["problems"]
    assert all(p["code"] == "unreadable" for p in got.values())
    refused = "refused: not a weights-only torch file (it asks for "
    assert got["conv-1.pt"]["message"].startswith(refused + "posix.system)"), got["conv-1.pt"]
    assert got["conv-2.pt"]["message"].startswith(refused + f"{__name__}.Custom)"), got["conv-2.pt"]
    assert got["conv-3.pt"]["message"].startswith(refused + "posix.system)"), got["conv-3.pt"]
    assert got["data_0.ckpt.gz"]["message"].startswith(refused + "posix.system)"), got["data_0.ckpt.gz"]
    assert "nothing else in it was unpickled or run" in got["conv-1.pt"]["message"]
