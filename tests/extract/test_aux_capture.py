"""The aux capture path on the real vLLM CPU engine with torch.compile on: equals HF transformers.

On a GPU the worker extension reads the states from vLLM's EAGLE-3 aux hidden-state outputs so that
torch.compile and CUDA graphs stay on (the default there). The CPU engine has no CUDA graphs, but it does
compile the model unless run eager, so `EAGLEWATCH_CAPTURE=aux` here runs the same path through a compiled
model: the aux outputs must be switched on before vLLM compiles, and the capture must come out of the
compiled graph. Output-convention ids are used on purpose, so the id → aux index mapping is exercised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import IN_PROCESS_ENGINE, JobResult, run_job, token_dataset, write_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

LENGTHS = [5, 37, 12, 64, 1, 50]
LAYERS = [1, 3, 4, 7]  # output convention: the inputs of layers 2, 4, 5 and the last layer's output (N = 8)


@pytest.fixture(scope="module")
def compiled(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("aux")
    data = tmp / "data.jsonl"
    samples = token_dataset(data, LENGTHS, seed=7)
    out = tmp / "out"
    spec = write_spec(
        tmp / "spec.json",
        model=str(tiny_llama),
        dataset=str(data),
        output_dir=str(out),
        layers=LAYERS,
        layer_convention="output",
        batch_size=4,
        # chunked prefill: prompts cross steps, so attribution through the aux path is tested too
        vllm_args=["--dtype", "float32", "--max-num-batched-tokens", "24", "--max-num-seqs", "4"],
    )
    # the compiled model and its aux outputs are the subject, not vLLM's process layout
    job = run_job(spec, env={"EAGLEWATCH_CAPTURE": "aux", **IN_PROCESS_ENGINE})
    return {"model": tiny_llama, "samples": samples, "out": out, "job": job}


def test_the_job_ran_compiled_through_aux_outputs(compiled: dict[str, Any]) -> None:
    job: JobResult = compiled["job"]
    assert job.rc == 0, job.output[-3000:]
    conf = job.of("engine_config")[0]
    assert (conf["capture"], conf["compiled"], conf["cuda_graphs"]) == ("aux", True, False)
    assert "EAGLEWATCH_CAPTURE=aux (your setting)" in conf["capture_reason"]
    assert conf["defaults"]["EAGLEWATCH_AUX_LAYERS"] == "2,4,5,8"
    assert (
        conf["defaults"]["VLLM_DISABLE_COMPILE_CACHE"] == "1"
    )  # a cached plain compile lacks the aux outputs
    assert job.of("capture_configured")[0]["capture"] == "aux"
    assert job.of("completed")[0]["samples"] == len(LENGTHS)


def test_compiled_aux_capture_equals_hf_transformers(compiled: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    from tests.extract.reference import hf_states, max_rel_err

    samples = compiled["samples"]
    refs = hf_states(compiled["model"], samples, [k + 1 for k in LAYERS])  # the reference takes input ids
    out: Path = compiled["out"]
    for i, (ids, ref) in enumerate(zip(samples, refs, strict=True)):
        got = load_file(str(out / f"hs_{i}.safetensors"))
        assert got["token_ids"].tolist() == ids
        assert tuple(got["hidden_states"].shape) == (len(ids), len(LAYERS), 128)
        for j, k in enumerate(LAYERS):
            err = max_rel_err(got["hidden_states"][:, j], ref[:, j])
            assert err < 1e-4, f"sample {i} (T={len(ids)}) layer id {k}: rel err {err:.2e}"
