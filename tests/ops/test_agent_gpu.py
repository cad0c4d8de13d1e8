"""The agent daemon's GPU paths (`gpus` op, `stop` → `gpu_released`) through a real daemon and real jobs.

This machine has no GPU, so a stand-in `nvidia-smi` (a Python script, put in place through
EAGLEWATCH_NVIDIA_SMI) answers the two CSV queries: the GPU line recorded on the real H200, and one
"process holding 20998 MiB" line for every pid listed in a holders file while that process is alive. The
same checks ran on the real H200 against the real nvidia-smi: tests/fixtures/h200-agent-gpu-check.txt
(script: tests/ops/h200/agent_gpu_check.py).
"""

from __future__ import annotations

import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.agentproc import AgentClient, AgentProc, cleanup_runs, start_agent

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nvidia-smi"
UUID = "GPU-eb00ebd1-8708-a4aa-5053-122bb6d20cec"

STAND_IN = """
import sys
from pathlib import Path
holders, gpu_line, sticky = Path(sys.argv[0]).with_name("holders"), {gpu_line!r}, {sticky!r}

def alive(pid):
    try:
        return Path(f"/proc/{{pid}}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

if sys.argv[1].startswith("--query-gpu="):
    print(gpu_line)
elif sys.argv[1].startswith("--query-compute-apps="):
    pids = holders.read_text().split() if holders.exists() else []
    for pid in pids:
        if sticky or alive(int(pid)):
            print(f"{{pid}}, {uuid}, 20998")
else:
    sys.exit("stand-in nvidia-smi: unexpected arguments " + " ".join(sys.argv[1:]))
"""

# The job "takes GPU memory" by listing its pid in the holders file, then sleeps.
JOB = (
    "import os, sys, time\n"
    "open(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\n"
    "print('holding', flush=True)\n"
    "time.sleep(60)"
)


def stand_in(folder: Path, sticky: bool) -> Path:
    """Write the stand-in nvidia-smi; ``sticky``: killed pids stay listed (memory never released)."""
    folder.mkdir()
    gpu_line = (FIXTURES / "query-gpu-busy.csv").read_text().strip()
    path = folder / "nvidia-smi"
    body = STAND_IN.format(gpu_line=gpu_line, sticky=sticky, uuid=UUID)
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def daemon_with(tmp_path: Path, sticky: bool) -> Iterator[tuple[AgentProc, Path]]:
    """A real daemon whose nvidia-smi is the stand-in; yields it and the holders file."""
    smi = stand_in(tmp_path / "smi", sticky)
    state = tmp_path / "state"
    agent = start_agent(state, env={"EAGLEWATCH_NVIDIA_SMI": str(smi)})
    try:
        yield agent, smi.with_name("holders")
    finally:
        agent.kill()
        cleanup_runs(state)


@pytest.fixture
def gpu_daemon(tmp_path: Path) -> Iterator[tuple[AgentProc, Path]]:
    """Daemon + stand-in GPU that frees memory when its holder dies."""
    yield from daemon_with(tmp_path, sticky=False)


@pytest.fixture
def sticky_daemon(tmp_path: Path) -> Iterator[tuple[AgentProc, Path]]:
    """Daemon + stand-in GPU that keeps listing a killed holder (memory not given back)."""
    yield from daemon_with(tmp_path, sticky=True)


def launch_holder(client: AgentClient, state: Path, holders: Path, run: str) -> int:
    """Launch a job that holds 'GPU memory'; return its pid once it holds it."""
    spec = {
        "name": run,
        "host": "here",
        "backend": "command",
        "command": [sys.executable, "-c", JOB, str(holders)],
    }
    client.result("launch", run=run, spec=spec)
    log = state / "runs" / run / "output.log"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (log.exists() and "holding" in log.read_text()):
        time.sleep(0.05)
    [pid] = [int(p) for p in holders.read_text().split()]
    return pid


def test_gpus_op_reports_the_holding_job(gpu_daemon: tuple[AgentProc, Path]) -> None:
    agent, holders = gpu_daemon
    with AgentClient(agent.socket) as client:
        assert client.result("gpus")["processes"] == []
        pid = launch_holder(client, agent.state_dir, holders, "hold1")
        result = client.result("gpus")
        assert [g["name"] for g in result["gpus"]] == ["NVIDIA H200"]
        assert result["processes"] == [{"pid": pid, "gpu_uuid": UUID, "used_memory_mib": 20998}]


def test_stop_confirms_gpu_released(gpu_daemon: tuple[AgentProc, Path]) -> None:
    agent, holders = gpu_daemon
    with AgentClient(agent.socket) as client:
        pid = launch_holder(client, agent.state_dir, holders, "hold2")
        stop = client.result("stop", run="hold2", grace_s=5)
        assert pid in {k["pid"] for k in stop["killed"]}
        assert stop["confirmed"] is True
        assert stop["gpu_released"] is True
        assert client.result("gpus")["processes"] == []


def test_stop_says_when_gpu_memory_is_still_held(sticky_daemon: tuple[AgentProc, Path]) -> None:
    agent, holders = sticky_daemon
    with AgentClient(agent.socket) as client:
        pid = launch_holder(client, agent.state_dir, holders, "hold3")
        stop = client.result("stop", run="hold3", grace_s=5)
        assert pid in {k["pid"] for k in stop["killed"]}
        assert stop["gpu_released"] is False
