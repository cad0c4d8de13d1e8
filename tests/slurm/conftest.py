"""A real one-node Slurm cluster (.ci/slurm-up) for every Slurm test of the session, and a fast poller."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: The tests' poll pace: the default 10 s would make each test wait tens of seconds for the scheduler.
POLL_S = "1"


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``.ci/slurm-up DIR`` once for the session (the node idle), ``.ci/slurm-down DIR`` at the end."""
    if shutil.which("sbatch") is None or not Path("/usr/sbin/slurmctld").exists():
        pytest.fail("Slurm is not installed: .ci/setup installs slurmctld, slurmd, munge and slurm-client")
    cluster = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(
        [str(REPO / ".ci/slurm-up"), str(cluster)], capture_output=True, text=True, timeout=60
    )
    if up.returncode != 0:
        pytest.fail(f".ci/slurm-up failed ({up.returncode}): {up.stderr[-2000:]}")
    os.environ["SLURM_CONF"] = str(cluster / "slurm.conf")
    os.environ["EAGLEWATCH_SLURM_POLL_S"] = POLL_S
    try:
        yield cluster
    finally:
        subprocess.run([str(REPO / ".ci/slurm-down"), str(cluster)], capture_output=True, timeout=60)
        os.environ.pop("SLURM_CONF", None)
        os.environ.pop("EAGLEWATCH_SLURM_POLL_S", None)
