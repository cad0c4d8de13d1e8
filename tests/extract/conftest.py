"""The tiny Llama's kill-and-resume capture, run once: the Llama test asserts on it, the TP test compares."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import (
    BARE_ENV,
    CHUNKED,
    FLOAT32,
    IN_PROCESS_ENGINE,
    LAYERS,
    LLAMA_LENGTHS,
    run_job,
    token_dataset,
    write_spec,
)


@pytest.fixture(scope="session")
def llama_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A worker-extension spec at TP=1 asking for chunked prefill and float32 only: run 1 is SIGKILLed after
    its first batch, one of its files is then truncated, run 2 resumes in vLLM's default process layout with
    a costs trace."""
    tmp = tmp_path_factory.mktemp("llama")
    data = tmp / "data.jsonl"
    samples = token_dataset(data, LLAMA_LENGTHS, seed=7)
    out = tmp / "out"
    spec = write_spec(
        tmp / "spec.json",
        model=str(tiny_llama),
        dataset=str(data),
        output_dir=str(out),
        layers=LAYERS,
        batch_size=4,
        vllm_args=[*CHUNKED, *FLOAT32],
    )
    # the run that is killed needs no engine process of its own (jobrun.IN_PROCESS_ENGINE); its results are
    # taken in between batches, which keeps its milestones in step with its files: the kill on the first
    # batch's lands before the last batch, unless the machine keeps this process from reading the line
    # until the job is done (seen under CI load): then the attempt is made again on an empty directory
    for _ in range(3):
        first = run_job(
            spec,
            env={**BARE_ENV, **IN_PROCESS_ENGINE},
            stop_when=lambda e: e["kind"] == "batch_captured",
            args=("--results-between-batches",),
        )
        if "completed" not in first.kinds():
            break
        shutil.rmtree(out)
    after_kill = sorted(p.name for p in out.glob("hs_*.safetensors"))
    stats = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("hs_*.safetensors")}
    truncated = after_kill[0]
    with open(out / truncated, "r+b") as fh:  # an invalid file: must be rewritten
        fh.truncate(100)
    trace = tmp / "costs-trace.json"
    second = run_job(spec, env={**BARE_ENV, "EAGLEWATCH_COSTS_TRACE": str(trace), "EAGLEWATCH_WRITERS": "2"})
    log = tmp / "second.log"
    log.write_text(second.output)
    return {
        "model": tiny_llama,
        "data": data,
        "samples": samples,
        "out": out,
        "first": first,
        "second": second,
        "log": log,
        "after_kill": after_kill,
        "stats": stats,
        "truncated": truncated,
        "trace": trace,
    }
