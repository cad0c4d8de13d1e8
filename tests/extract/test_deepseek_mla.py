"""worker-extension backend on a tiny DeepSeek-V3 (MLA + MoE) on the real vLLM CPU engine.

The reference is vLLM's own EAGLE-3 aux hidden states (`set_aux_hidden_state_layers`, the definition of
the "input" convention) recorded on the same engine steps by tests/extract/aux_ext.py and assembled per
request into a second directory. bf16: the CPU fused-MoE kernel refuses fp32 weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import IN_PROCESS_ENGINE, LAYERS, run_job, token_dataset, write_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

LENGTHS = [5, 37, 1, 64, 23, 9]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from agent.extract.tinymodel import build

    tmp = tmp_path_factory.mktemp("ds3")
    model = build(tmp / "model", "deepseek_v3", seed=5)
    data = tmp / "data.jsonl"
    samples = token_dataset(data, LENGTHS, seed=11)
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
        env={"EAGLEWATCH_AUX_DIR": str(aux), **IN_PROCESS_ENGINE},  # MLA is the subject, not vLLM's layout
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
