"""Session fixtures shared across folders (the tiny Llama, the one-job capture sharded runs must equal) and
the grouping of tests for parallel runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


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
