"""Session fixtures shared across folders (the tiny Llama, the one-job capture sharded runs must equal, the
one-node Slurm cluster) and the grouping of tests for parallel runs."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (8 layers, hidden 128, fp32, fixed seed), built once; tests only read it."""
    from agent.extract.tinymodel import build

    return build(tmp_path_factory.mktemp("tiny-llama") / "model", "llama", seed=5)


@pytest.fixture(scope="session")
def sharded_whole(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sharding tests' dataset captured by one unsharded job: what the shards must add up to.

    ``common`` holds the spec fields every sharded run of it repeats (engine args included: equal
    batching keeps the files bit for bit equal).
    """
    from tests.extract import jobrun

    tmp = tmp_path_factory.mktemp("sharded-whole")
    data = tmp / "data.jsonl"
    jobrun.token_dataset(data, jobrun.SHARD_LENGTHS, seed=11)
    common = {
        "model": str(tiny_llama),
        "dataset": str(data),
        "layers": jobrun.LAYERS,
        "batch_size": 2,
        "vllm_args": ["--dtype", "float32", "--max-num-seqs", "2"],
    }
    out = tmp / "whole"
    spec = jobrun.write_spec(tmp / "whole.json", output_dir=str(out), **common)
    return {"common": common, "out": out, "job": jobrun.run_job(spec, env=jobrun.IN_PROCESS_ENGINE)}


#: Test files that share one xdist worker under ``-n N --dist loadfile`` (every other file is a scope of its
#: own): the Slurm tests share the session's one cluster, and with the sharded runs the one unsharded capture
#: (``sharded_whole``, made once a worker); the two TP=8 modules run one after the other (eight ranks each:
#: the Kimi-like one alone peaks near 20 GiB on a 24-GiB machine).
SHARED_WORKER = {
    "tests/adversarial/test_held_task_ends.py": "slurm",
    "tests/controller/test_sharded_runs.py": "slurm",
    "tests/extract/test_sharded_capture.py": "slurm",
    "tests/extract/test_tensor_parallel.py": "tp8",
    "tests/extract/test_seed_shape_tp8.py": "tp8",
}
#: Scopes handed out first, in this order (with --no-loadscope-reorder xdist keeps collection order): the
#: longest start at once, so that the last scope to start is a short one.
LONGEST_FIRST = ("tp8", "slurm")


def scope(nodeid: str) -> str:
    """The xdist scope of a test: its file, or the group its file shares a worker with."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/slurm/"):
        return "slurm"
    return SHARED_WORKER.get(path, path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the files of SHARED_WORKER grouped (xdist's own loadgroup cannot tag node
    ids under pytest 9)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    return SharedFileScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest scopes first (a stable sort: every other test keeps its place)."""
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(scope(item.nodeid), len(order)))
