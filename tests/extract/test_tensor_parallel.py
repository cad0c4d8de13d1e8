"""Tensor parallelism at TP=8 on the real vLLM CPU engine: files equal HF, one writer, one injection.

An 8-head tiny Llama (hidden 256, 8 layers) is built on the spot and extracted through `eaglewatch-agent
extract` at TP=8 with a bare spec (no dtype, no KV-cache size, no thread binding): on a machine with fewer
CPUs than ranks the job must bind the ranks round-robin, say so, and run. Chunked prefill is forced so steps
mix requests. The agent's own rules read the log for the injection milestone of all eight ranks.

The worker-extension run uses tests/extract/aux_ext.py, which also records vLLM's own EAGLE-3 aux hidden
states on the same steps: the capture must equal them bit for bit, and HF transformers within 1e-4.
The vllm-native backend (vLLM's extract_hidden_states and our connector: a synchronous CPU write, loaded
through kv_connector_module_path) runs at TP=8 too, with layer ids in the "output" convention: it must equal
the worker extension's files and HF transformers. MLA under TP: tests/extract/test_seed_shape_tp8.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import (
    BARE_ENV,
    CHUNKED,
    FLOAT32,
    LAYERS,
    JobResult,
    run_job,
    token_dataset,
    write_spec,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

TP = 8
HIDDEN = 256
#: the 4-head tiny Llama stops at TP=4 (heads must divide by TP): 8 heads of 32, hidden 256
LLAMA8 = {"hidden_size": HIDDEN, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32}
#: few prompts, each engine step costs eight ranks' collectives: 37 tokens still cross chunked steps
LENGTHS = [5, 37, 1, 23]
AUX_EXT = "tests.extract.aux_ext.AuxCompareCapture"
OUTPUT_LAYERS = [1, 3, 4, 7]  # "output" convention: leaving layer k == entering layer k + 1 (vLLM's aux ids)


def _spec(tmp: Path, model: Path, data: Path, name: str, **more: Any) -> Path:
    """A TP=8 spec writing into ``tmp/name``, one batch, chunked prefill, float32."""
    return write_spec(
        tmp / f"{name}.json", model=str(model), dataset=str(data), output_dir=str(tmp / name),
        batch_size=len(LENGTHS), vllm_args=[*CHUNKED, *FLOAT32], tensor_parallel_size=TP, **more,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from agent.extract.tinymodel import build

    tmp = tmp_path_factory.mktemp("tp8")
    model, data = build(tmp / "model", "llama", seed=5, overrides=LLAMA8), tmp / "data.jsonl"
    samples = token_dataset(data, LENGTHS, seed=7)
    (tmp / "aux").mkdir()
    ext = run_job(
        _spec(tmp, model, data, "out", layers=LAYERS),
        timeout=900,
        env={**BARE_ENV, "EAGLEWATCH_AUX_DIR": str(tmp / "aux")},
        args=("--worker-extension", AUX_EXT),
    )
    log = tmp / "tp8.log"
    log.write_text(ext.output)
    native = _spec(
        tmp, model, data, "out-native", backend="vllm-native", layers=OUTPUT_LAYERS, layer_convention="output"
    )
    return {
        "samples": samples,
        "model": model,
        "ext": {"job": ext, "out": tmp / "out", "log": log, "aux": tmp / "aux"},
        "native": {"job": run_job(native, timeout=900, env=BARE_ENV), "out": tmp / "out-native"},
    }


def _files(out: Path) -> dict[int, dict[str, Any]]:
    from safetensors.torch import load_file

    return {int(p.stem.split("_")[1]): load_file(str(p)) for p in out.glob("hs_*.safetensors")}


def test_tp8_starts_on_fewer_cpus_bound_round_robin_and_says_so(runs: dict[str, Any]) -> None:
    from agent.extract.engine.runtime import thread_binding

    cpus = sorted(os.sched_getaffinity(0))
    for name in ("ext", "native"):
        job: JobResult = runs[name]["job"]
        assert job.rc == 0, job.output[-4000:]
        assert job.kinds()[-1] == "completed"
        conf = job.of("engine_config")[0]
        assert conf["platform"] == "cpu" and conf["model_runner"] == "v1" and conf["cuda_graphs"] is False
        assert "vllm_args" not in conf["defaults"]  # no dtype default over the spec's
        assert conf["defaults"]["VLLM_CPU_OMP_THREADS_BIND"] == thread_binding(cpus, TP)
        shared = [w for w in job.of("warning") if "ranks share CPUs" in w["message"]]
        assert len(shared) == (1 if len(cpus) < TP else 0), job.of("warning")
        assert ("round-robin" in conf["reasons"]["VLLM_CPU_OMP_THREADS_BIND"]) == (len(cpus) < TP)
        captured = job.of("capture_configured")[0]
        assert captured["tensor_parallel_size"] == TP and captured["hidden_size"] == HIDDEN
        assert captured["dtype"] == "float32"
    assert runs["ext"]["job"].of("capture_configured")[0]["model_runner"] == "v1"  # the extension's own word


def test_tp8_equals_vllm_aux_states_on_the_same_steps(runs: dict[str, Any]) -> None:
    import torch

    got, aux = _files(runs["ext"]["out"]), _files(runs["ext"]["aux"])
    assert sorted(got) == sorted(aux) == list(range(len(LENGTHS)))
    for idx in got:
        assert torch.equal(got[idx]["hidden_states"], aux[idx]["hidden_states"]), f"sample {idx} != aux"


def test_tp8_equals_hf_transformers(runs: dict[str, Any]) -> None:
    from tests.extract.reference import hf_states, max_rel_err

    got = _files(runs["ext"]["out"])
    refs = hf_states(runs["model"], runs["samples"], LAYERS)
    for i, (ids, ref) in enumerate(zip(runs["samples"], refs, strict=True)):
        assert got[i]["token_ids"].tolist() == ids
        assert tuple(got[i]["hidden_states"].shape) == (len(ids), len(LAYERS), HIDDEN)
        for slot, k in enumerate(LAYERS):
            err = max_rel_err(got[i]["hidden_states"][:, slot], ref[:, slot])
            assert err < 1e-4, f"sample {i} layer {k}: rel err {err:.2e}"


def test_tp8_has_one_writer_and_a_right_manifest(runs: dict[str, Any]) -> None:
    job: JobResult = runs["ext"]["job"]
    passed = [e["file"] for e in job.of("shape_check_passed")]
    assert sorted(passed) == sorted(f"hs_{i}.safetensors" for i in range(len(LENGTHS)))  # each file once
    out: Path = runs["ext"]["out"]
    assert not list(out.glob("*.tmp")) and not list(out.glob(".staging-*"))
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["layer_ids"] == LAYERS and doc["hidden_size"] == HIDDEN and doc["dtype"] == "float32"
    assert doc["tokens_total"] == sum(LENGTHS) and doc["samples_written"] == len(LENGTHS)
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "check",
        str(out),
        "--layers",
        "2,4,5,8",
        "--hidden-size",
        str(HIDDEN),
    ]
    check = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert json.loads(check.stdout)["files"] == len(LENGTHS)


def test_tp8_log_gives_one_injection_milestone_for_all_ranks(runs: dict[str, Any]) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "agent", "milestones", str(runs["ext"]["log"]), "--tp", str(TP), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    found = [json.loads(line) for line in res.stdout.splitlines()]
    injected = [m for m in found if m["kind"] == "extension_injected"]
    assert len(injected) == 1, injected
    assert injected[0]["fields"]["ranks"] == list(range(TP))
    assert injected[0]["fields"]["extension"] == AUX_EXT  # a subclass of agent.extract.capture.worker_ext's


def test_vllm_native_tp8_milestones_canary_files_and_statistics(runs: dict[str, Any]) -> None:
    import torch

    job, out, n = runs["native"]["job"], runs["native"]["out"], len(LENGTHS)
    conf = job.of("capture_configured")[0]
    assert conf["tensor_parallel_size"] == TP
    assert conf["convention"] == "output" and conf["layers"] == OUTPUT_LAYERS
    assert conf["backend"] == "vllm-native" and conf["layer_class"] == "EagleWatchHiddenStatesConnector"
    assert len(job.of("shape_check_passed")) == n
    # the canary for this backend: two samples captured alone through vLLM's connector, compared with files
    # (one batch: the first-batch round covers the end)
    canaries = job.of("canary_checked")
    assert [(c["when"], c["samples"], c["ok"]) for c in canaries] == [("first batch", 2, True)]
    assert all(c["max_rel_diff"] is not None and c["max_rel_diff"] <= 1e-3 for c in canaries)
    # only hs_N, the manifest, the per-file statistics and the ownership record remain: staging dir and
    # .lock files are cleaned up
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"hs_{i}.safetensors" for i in range(n)]
        + ["manifest.json", "layer_stats.jsonl", ".eaglewatch-owner.json"]
    )
    # per-layer statistics for this backend too (read from the connector's files): RMS over the run
    stats = json.loads((out / "manifest.json").read_text())["layer_stats"]
    files = _files(out)
    for j, k in enumerate(OUTPUT_LAYERS):
        states = torch.cat([files[i]["hidden_states"][:, j] for i in range(n)])
        rms = float(states.double().square().mean().sqrt())
        assert abs(stats[str(k)]["rms"] - rms) <= 1e-4 * rms and stats[str(k)]["non_finite"] == 0


def test_vllm_native_tp8_equals_worker_extension_tp8(runs: dict[str, Any]) -> None:
    import torch

    from tests.extract.reference import max_rel_err

    ext, native = _files(runs["ext"]["out"]), _files(runs["native"]["out"])
    assert sorted(native) == sorted(ext) == list(range(len(LENGTHS)))
    for idx, ids in enumerate(runs["samples"]):
        got = native[idx]["hidden_states"]
        assert native[idx]["token_ids"].tolist() == ext[idx]["token_ids"].tolist() == ids
        assert got.dtype == torch.float32 and tuple(got.shape) == (len(ids), len(OUTPUT_LAYERS), HIDDEN)
        err = max_rel_err(got, ext[idx]["hidden_states"])  # the same states, in input-convention ids
        assert err <= 1e-4, f"sample {idx}: vllm-native vs worker extension at TP=8, rel err {err:.2e}"
