"""worker-extension backend on the real vLLM CPU engine, tiny Llama fp32: equals HF transformers; resume.

Every assertion below reads the session's kill-and-resume scenario (tests/extract/conftest.py
``llama_run``): run 1 is SIGKILLed after its first batch, one of its files is then truncated, run 2
resumes (with a costs trace) in vLLM's default process layout, whose log also feeds the agent's milestone
rules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import LAYERS, ROOT, JobResult
from tests.extract.jobrun import LLAMA_LENGTHS as LENGTHS

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def _load(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_second_run_completes_with_milestone_lines(llama_run: dict[str, Any]) -> None:
    second: JobResult = llama_run["second"]
    assert second.rc == 0, second.output[-3000:]
    kinds = second.kinds()
    # the disk forecast comes before any engine starts
    assert kinds[:3] == ["forecast", "engine_config", "capture_configured"] and kinds[-1] == "completed"
    engine = second.of("engine_config")[0]
    assert engine["platform"] == "cpu" and engine["model_runner"] == "v1" and engine["cuda_graphs"] is False
    conf = second.of("capture_configured")[0]
    assert conf["layers"] == LAYERS and conf["convention"] == "input" and conf["hidden_size"] == 128
    assert conf["dtype"] == "float32" and conf["backend"] == "worker-extension"
    tune = {"pinned_buffers": 6, "writers": 2, "writeback_mb": 1024, "trace": str(llama_run["trace"])}
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
    rows = json.loads(llama_run["trace"].read_text())  # one row per captured step, written at each drain
    assert len(rows) == costs["steps"] and all(0 < r["tokens"] <= 24 for r in rows)
    last = second.of("progress")[-1]
    assert last["samples_done"] == last["samples_total"] == len(LENGTHS)
    assert "shape_check_failed" not in kinds


def test_resume_writes_only_missing_or_invalid(llama_run: dict[str, Any]) -> None:
    first: JobResult = llama_run["first"]
    assert first.rc != 0 and "completed" not in first.kinds()  # really killed mid-run
    after_kill = llama_run["after_kill"]
    assert 0 < len(after_kill) < len(LENGTHS)
    rewritten = {e["file"] for e in llama_run["second"].of("shape_check_passed")}
    all_files = {f"hs_{i}.safetensors" for i in range(len(LENGTHS))}
    assert rewritten == (all_files - set(after_kill)) | {llama_run["truncated"]}
    out: Path = llama_run["out"]
    for name, (ino, mtime) in llama_run["stats"].items():
        if name != llama_run["truncated"]:
            st = (out / name).stat()
            assert (st.st_ino, st.st_mtime_ns) == (ino, mtime), f"{name} was rewritten"
    assert sorted(p.name for p in out.glob("hs_*.safetensors")) == sorted(all_files)
    assert not list(out.glob(".*tmp"))


def test_captured_states_equal_hf_reference(llama_run: dict[str, Any]) -> None:
    import torch

    from tests.extract.reference import hf_states, max_rel_err

    samples = llama_run["samples"]
    refs = hf_states(llama_run["model"], samples, LAYERS)
    for i, (ids, ref) in enumerate(zip(samples, refs, strict=True)):
        got = _load(llama_run["out"] / f"hs_{i}.safetensors")
        assert got["token_ids"].tolist() == ids
        assert got["hidden_states"].dtype == torch.float32
        assert tuple(got["hidden_states"].shape) == (len(ids), len(LAYERS), 128)
        for j, k in enumerate(LAYERS):
            err = max_rel_err(got["hidden_states"][:, j], ref[:, j])
            assert err < 1e-4, f"sample {i} (T={len(ids)}) layer id {k}: rel err {err:.2e}"


def test_manifest(llama_run: dict[str, Any]) -> None:
    doc = json.loads((llama_run["out"] / "manifest.json").read_text())
    assert doc["format_version"] == 1
    assert doc["layer_ids"] == LAYERS and doc["layer_convention"] == "input"
    assert doc["hidden_size"] == 128 and doc["dtype"] == "float32"
    assert doc["samples"] == {str(i): n for i, n in enumerate(LENGTHS)}
    assert doc["tokens_total"] == sum(LENGTHS) and doc["samples_written"] == len(LENGTHS)
    assert doc["versions"]["vllm"] and doc["versions"]["torch"]
    from agent.checks.checker import Expectation, check_path

    report = check_path(llama_run["out"], Expectation(layers=len(LAYERS), hidden_size=128))
    assert report.ok and report.files == len(LENGTHS), report.to_dict()
    assert doc["command"][-2:] == ["--spec", str(Path(doc["command"][-1]))] and os.path.isabs(doc["model"])


def test_the_engine_log_gives_the_start_up_milestones(llama_run: dict[str, Any]) -> None:
    """vLLM's own CPU engine lines in the job's log (default process layout) feed the agent's rules."""
    res = subprocess.run(
        [sys.executable, "-m", "agent", "milestones", str(llama_run["log"]), "--json"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    rules = {r["fields"].get("rule"): r for r in rows}
    assert rules["architecture"]["fields"]["architecture"] == "LlamaForCausalLM"
    assert rules["kv_cache_size"]["fields"]["device"] == "CPU"
    assert rules["kv_cache_size"]["fields"]["tokens"] > 0
    assert rules["weights_time"]["kind"] == "weights_loaded"
    assert rules["engine_ready"]["fields"]["seconds"] > 0
    assert "error" not in {r["kind"] for r in rows}
