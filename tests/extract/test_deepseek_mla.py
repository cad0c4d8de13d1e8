"""worker-extension backend on a tiny DeepSeek-V3 (MLA + MoE) on the real vLLM CPU engine.

The reference is vLLM's own EAGLE-3 aux hidden states (`set_aux_hidden_state_layers`, the definition of
the "input" convention) recorded on the same engine steps by tests/extract/aux_ext.py and assembled per
request into a second directory. bf16: the CPU fused-MoE kernel refuses fp32 weights.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import run_job, write_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

LENGTHS = [5, 37, 1, 64, 23, 9]
LAYERS = [2, 4, 5, 8]  # tiny DeepSeek-V3 N = 8; id 8 = final pre-norm output (dropped by vLLM 0.19.1)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from agent.extract.tinymodel import build

    tmp = tmp_path_factory.mktemp("ds3")
    model = build(tmp / "model", "deepseek_v3", seed=5)
    rng = random.Random(11)
    samples = [[rng.randrange(4, 500) for _ in range(n)] for n in LENGTHS]
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in samples))
    out, aux = tmp / "out", tmp / "aux"
    aux.mkdir()
    spec = write_spec(
        tmp / "spec.json",
        model=str(model),
        dataset=str(data),
        output_dir=str(out),
        layers=LAYERS,
        batch_size=len(LENGTHS),
        # bf16 asked for explicitly: the user's dtype wins over the job's CPU default (float32)
        vllm_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "6", "--dtype", "bfloat16"],
    )
    job = run_job(
        spec,
        env={"EAGLEWATCH_AUX_DIR": str(aux)},
        args=("--worker-extension", "tests.extract.aux_ext.AuxCompareCapture"),
    )
    return {"job": job, "samples": samples, "out": out, "aux": aux}


def test_job_completes_on_mla_layers(scenario: dict[str, Any]) -> None:
    job = scenario["job"]
    assert job.rc == 0, job.output[-3000:]
    assert "vllm_args" not in job.of("engine_config")[0]["defaults"]  # no dtype default over the user's
    conf = job.of("capture_configured")[0]
    assert conf["layer_class"] == "DeepseekV2DecoderLayer" and conf["layers"] == LAYERS
    assert len(job.of("shape_check_passed")) == len(LENGTHS) and not job.of("shape_check_failed")


def test_captured_equals_vllm_eagle3_aux_hidden_states(scenario: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file

    for i, ids in enumerate(scenario["samples"]):
        got = load_file(str(Path(scenario["out"]) / f"hs_{i}.safetensors"))
        ref = load_file(str(Path(scenario["aux"]) / f"hs_{i}.safetensors"))
        assert got["token_ids"].tolist() == ref["token_ids"].tolist() == ids
        assert tuple(got["hidden_states"].shape) == (len(ids), len(LAYERS), 128)
        assert got["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got["hidden_states"], ref["hidden_states"]), f"sample {i} differs from aux"
        assert bool(got["hidden_states"].float().abs().amax(dim=(0, 2)).gt(0).all())
