"""worker-extension backend on the real vLLM CPU engine, tiny Llama fp32: equals HF transformers; resume.

One module-scoped scenario (engine starts are expensive): run 1 is SIGKILLed after its first batch, one of
its files is then truncated, run 2 resumes (with a costs trace). Every assertion below reads that
scenario's results.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import JobResult, run_job, write_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

LENGTHS = [5, 37, 12, 64, 1, 50, 23, 9, 41, 17]
LAYERS = [2, 4, 5, 8]  # tiny Llama N = 8: EAGLE-3 [2, N//2, N-3, N]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from agent.extract.tinymodel import build

    tmp = tmp_path_factory.mktemp("llama")
    model = build(tmp / "model", "llama", seed=3)
    rng = random.Random(7)
    samples = [[rng.randrange(4, 500) for _ in range(n)] for n in LENGTHS]
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in samples))
    out = tmp / "out"
    spec = write_spec(
        tmp / "spec.json",
        model=str(model),
        dataset=str(data),
        output_dir=str(out),
        layers=LAYERS,
        batch_size=4,
        # chunked prefill forced: 64-token prompts cross steps of at most 24 tokens, mixed with others
        vllm_args=["--dtype", "float32", "--max-num-batched-tokens", "24", "--max-num-seqs", "4"],
    )
    first = run_job(spec, stop_when=lambda e: e["kind"] == "batch_captured")
    after_kill = sorted(p.name for p in out.glob("hs_*.safetensors"))
    stats = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("hs_*.safetensors")}
    truncated = sorted(after_kill)[0]
    with open(out / truncated, "r+b") as fh:  # an invalid file: must be rewritten
        fh.truncate(100)
    # the resumed run with a costs trace and two writer threads
    trace = tmp / "costs-trace.json"
    second = run_job(spec, env={"EAGLEWATCH_COSTS_TRACE": str(trace), "EAGLEWATCH_WRITERS": "2"})
    return {
        "model": model,
        "samples": samples,
        "out": out,
        "first": first,
        "second": second,
        "after_kill": after_kill,
        "stats": stats,
        "truncated": truncated,
        "trace": trace,
    }


def _load(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_second_run_completes_with_milestone_lines(scenario: dict[str, Any]) -> None:
    second: JobResult = scenario["second"]
    assert second.rc == 0, second.output[-3000:]
    kinds = second.kinds()
    # the disk forecast comes before any engine starts
    assert kinds[:3] == ["forecast", "engine_config", "capture_configured"] and kinds[-1] == "completed"
    engine = second.of("engine_config")[0]
    assert engine["platform"] == "cpu" and engine["model_runner"] == "v1" and engine["cuda_graphs"] is False
    conf = second.of("capture_configured")[0]
    assert conf["layers"] == LAYERS and conf["convention"] == "input" and conf["hidden_size"] == 128
    assert conf["dtype"] == "float32" and conf["backend"] == "worker-extension"
    tune = {"pinned_buffers": 6, "writers": 2, "writeback_mb": 1024, "trace": str(scenario["trace"])}
    got = dict(conf["tuning"])
    assert got.pop("writer_start_s") > 0  # setup waited for the writer process to start
    assert got == tune
    assert conf["stats_kernel"] == "eager: cpu device"  # the fused kernel is compiled on CUDA only
    done = second.of("completed")[0]
    assert done["samples"] == len(LENGTHS) and done["tokens"] == sum(LENGTHS)
    costs = done["capture_costs"]  # where the capture's time went; the child's writes come back with drains
    assert (
        costs["steps"] >= 1 and costs["forward_thread_s"] > 0 and costs["files"] >= 1 and costs["write_s"] > 0
    )
    assert costs["forward_thread_ms_max"] >= costs["forward_thread_ms_p50"] > 0
    # the child pushed each file to disk as it wrote it (no "writeback" reason: the pacing ran)
    assert costs["writeback_waits"] == 0 and costs["writeback_wait_s"] == 0 and "writeback" not in costs
    assert done["results_seconds"] > 0 and done["drain_seconds"] >= 0
    # with the writer process the results were taken in beside the next batch: the driver's share is a part
    assert 0 <= done["results_wait_seconds"] <= done["results_seconds"] + 0.005
    rows = json.loads(scenario["trace"].read_text())  # one row per captured step, written at each drain
    assert len(rows) == costs["steps"] and all(0 < r["tokens"] <= 24 for r in rows)
    last = second.of("progress")[-1]
    assert last["samples_done"] == last["samples_total"] == len(LENGTHS)
    assert "shape_check_failed" not in kinds


def test_resume_writes_only_missing_or_invalid(scenario: dict[str, Any]) -> None:
    first: JobResult = scenario["first"]
    assert first.rc != 0 and "completed" not in first.kinds()  # really killed mid-run
    after_kill = scenario["after_kill"]
    assert 0 < len(after_kill) < len(LENGTHS)
    rewritten = {e["file"] for e in scenario["second"].of("shape_check_passed")}
    all_files = {f"hs_{i}.safetensors" for i in range(len(LENGTHS))}
    assert rewritten == (all_files - set(after_kill)) | {scenario["truncated"]}
    out: Path = scenario["out"]
    for name, (ino, mtime) in scenario["stats"].items():
        if name != scenario["truncated"]:
            st = (out / name).stat()
            assert (st.st_ino, st.st_mtime_ns) == (ino, mtime), f"{name} was rewritten"
    assert sorted(p.name for p in out.glob("hs_*.safetensors")) == sorted(all_files)
    assert not list(out.glob(".*tmp"))


def test_captured_states_equal_hf_reference(scenario: dict[str, Any]) -> None:
    import torch

    from tests.extract.reference import hf_states, max_rel_err

    samples = scenario["samples"]
    refs = hf_states(scenario["model"], samples, LAYERS)
    for i, (ids, ref) in enumerate(zip(samples, refs, strict=True)):
        got = _load(scenario["out"] / f"hs_{i}.safetensors")
        assert got["token_ids"].tolist() == ids
        assert got["hidden_states"].dtype == torch.float32
        assert tuple(got["hidden_states"].shape) == (len(ids), len(LAYERS), 128)
        for j, k in enumerate(LAYERS):
            err = max_rel_err(got["hidden_states"][:, j], ref[:, j])
            assert err < 1e-4, f"sample {i} (T={len(ids)}) layer id {k}: rel err {err:.2e}"


def test_manifest(scenario: dict[str, Any]) -> None:
    doc = json.loads((scenario["out"] / "manifest.json").read_text())
    assert doc["format_version"] == 1
    assert doc["layer_ids"] == LAYERS and doc["layer_convention"] == "input"
    assert doc["hidden_size"] == 128 and doc["dtype"] == "float32"
    assert doc["samples"] == {str(i): n for i, n in enumerate(LENGTHS)}
    assert doc["tokens_total"] == sum(LENGTHS) and doc["samples_written"] == len(LENGTHS)
    assert doc["versions"]["vllm"] and doc["versions"]["torch"]
    from agent.checks.checker import Expectation, check_path

    report = check_path(scenario["out"], Expectation(layers=len(LAYERS), hidden_size=128))
    assert report.ok and report.files == len(LENGTHS), report.to_dict()
    assert doc["command"][-2:] == ["--spec", str(Path(doc["command"][-1]))] and os.path.isabs(doc["model"])
