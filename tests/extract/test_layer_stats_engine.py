"""On the real CPU engine: forecast, per-layer statistics with progress and in the manifest, a layer that
collapses part-way through the run (inject_fault zero_layer), and canary re-captures (batch_skew)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.extract.capture.checks import BATCH_SKEW, ZERO_LAYER_FROM, ZERO_LAYER_SLOT
from tests.extract.jobrun import IN_PROCESS_ENGINE, run_job, write_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_zero_layer_collapse_is_seen_while_running(tiny_llama: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2} w7"}) + "\n" for i in range(7)))
    out = tmp_path / "out"
    spec = write_spec(
        tmp_path / "spec.json",
        model=str(tiny_llama),
        dataset=str(data),
        output_dir=str(out),
        batch_size=2,
        inject_fault="zero_layer",
        # fp32: on this CPU, bf16 with the default max_num_batched_tokens (1280) dies with SIGILL in vLLM
        vllm_args=["--dtype", "float32"],
    )
    # statistics/faults are the subject, not vLLM's layout; each drain's results taken in between batches:
    # the driver waits for all of it
    job = run_job(spec, env=IN_PROCESS_ENGINE, args=("--results-between-batches",))
    assert job.rc == 0, job.output[-3000:]
    done = job.of("completed")[0]
    assert done["results_seconds"] > 0
    # all of it: each is rounded to 1 ms; with the take overlapped the driver would wait for almost none
    assert done["results_wait_seconds"] >= done["results_seconds"] - 0.002
    (forecast,) = job.of("forecast")
    files = sorted(out.glob("hs_*.safetensors"))
    written = sum(f.stat().st_size for f in files)
    assert forecast["fits"] is True and forecast["estimated"] is False and forecast["samples"] == 7
    assert abs(forecast["bytes"] - written) <= 256 * len(files)  # only the header size is estimated
    progress = job.of("progress")
    layers = job.of("capture_configured")[0]["layers"]
    collapsed = layers[ZERO_LAYER_SLOT]
    assert all(p["free_bytes"] > 0 and p["disk_low"] is False for p in progress)
    assert all(set(p["layer_rms"]) == {str(k) for k in layers} for p in progress if p["layer_rms"])
    assert any("eta_s" in p for p in progress)
    findings = [f for p in progress for f in p.get("layer_collapse", [])]
    assert [(f["layer"], f["what"]) for f in findings] == [(collapsed, "collapse")], findings
    assert (
        findings[0]["file"] == f"hs_{ZERO_LAYER_FROM}.safetensors"
        and "RMS fell to 0" in findings[0]["message"]
    )
    assert progress[-1]["layer_rms"][str(collapsed)] == 0.0
    manifest = json.loads((out / "manifest.json").read_text())
    stats = manifest["layer_stats"]
    assert set(stats) == {str(k) for k in layers}
    assert (
        0.2 < stats[str(collapsed)]["zero_fraction"] < 0.8 and stats[str(layers[0])]["zero_fraction"] < 0.01
    )
    assert all(s["rms"] > 0 and s["non_finite"] == 0 for s in stats.values())
    per_file = [json.loads(ln) for ln in (out / "layer_stats.jsonl").read_text().splitlines()]
    assert sorted(p["idx"] for p in per_file) == list(range(7))
    # batched vs alone on the same engine: float32 reordering only, far inside the tolerance
    canaries = job.of("canary_checked")
    assert [(c["when"], c["samples"], c["ok"]) for c in canaries] == [
        ("first batch", 2, True),
        ("end", 2, True),  # the last batch is one sample: the batch before it is checked
    ]
    assert all(c["max_rel_diff"] < 1e-4 and c["tolerance"] == 1e-3 for c in canaries)


def test_batch_dependent_states_fail_the_canary_and_stop(tiny_llama: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2} w7"}) + "\n" for i in range(6)))
    spec = write_spec(
        tmp_path / "spec.json",
        model=str(tiny_llama),
        dataset=str(data),
        output_dir=str(tmp_path / "out"),
        batch_size=3,
        inject_fault="batch_skew",
        on_shape_failure="stop",
        vllm_args=["--dtype", "float32"],
    )  # writes pipelined with the next batch: under stop the canary must wait for the first batch's files
    job = run_job(spec, env=IN_PROCESS_ENGINE)  # statistics/faults are the subject, not vLLM's layout
    assert job.rc == 1, job.output[-3000:]
    (canary,) = job.of("canary_checked")
    assert canary["when"] == "first batch" and canary["samples"] == 2 and canary["ok"] is False
    assert canary["max_rel_diff"] == pytest.approx(BATCH_SKEW - 1, rel=1e-3)
    assert "shape_check_failed" not in job.kinds()  # right shapes, wrong contents: only the canary sees it
    (failed,) = job.of("failed")
    assert (
        "differ from their batched capture" in failed["reason"]
        and "on_shape_failure=stop" in failed["reason"]
    )
    assert len(job.of("batch_captured")) == 1  # stopped after the first batch
