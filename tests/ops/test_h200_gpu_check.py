"""The GPU host check on a machine with an NVIDIA GPU (skipped elsewhere, e.g. CI and this workstation).

It runs tests/ops/h200/agent_gpu_check.py: the real agent daemon, a job holding 20 GiB of GPU memory
launched through it, `gpus` seeing it, `stop` confirming `gpu_released` and nvidia-smi's memory going back.
The transcript of its run on the lent H200 is tests/fixtures/h200-agent-gpu-check.txt.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "h200" / "agent_gpu_check.py"


def cuda_python() -> bool:
    """Whether nvidia-smi answers and this Python's torch sees a GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not cuda_python(), reason="needs nvidia-smi and a CUDA torch (a GPU host)")
def test_agent_gpu_check(tmp_path: Path) -> None:
    transcript = tmp_path / "transcript.txt"
    result = subprocess.run([sys.executable, str(SCRIPT), str(transcript), "--gib", "4"], capture_output=True,
                            text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert "RESULT: ALL CHECKS PASSED" in transcript.read_text()
