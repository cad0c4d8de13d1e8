"""inject_fault on the real engine: the in-process check catches it and the policy decides (here: stop)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.extract.jobrun import IN_PROCESS_ENGINE, run_job, write_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_drop_layer_with_stop_policy_fails_the_job(tiny_llama: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2} w7"}) + "\n" for i in range(3)))
    spec = write_spec(
        tmp_path / "spec.json",
        model=str(tiny_llama),
        dataset=str(data),
        output_dir=str(tmp_path / "out"),
        batch_size=2,
        inject_fault="drop_layer",
        on_shape_failure="stop",
        # fp32: on this CPU, bf16 with the default max_num_batched_tokens (1280) dies with SIGILL in vLLM
        vllm_args=["--dtype", "float32"],
    )
    job = run_job(spec, env=IN_PROCESS_ENGINE)  # statistics/faults are the subject, not vLLM's layout
    assert job.rc == 1, job.output[-3000:]
    failed = job.of("shape_check_failed")
    assert failed and {f["code"] for f in failed} == {"layer_count_mismatch"}
    assert failed[0]["file"] == "hs_0.safetensors" and failed[0]["index"] == 0
    assert "3 layers, expected 4" in failed[0]["message"]
    assert job.kinds()[-1] == "failed" and "on_shape_failure=stop" in job.of("failed")[0]["reason"]
    assert "completed" not in job.kinds()
    assert not list((tmp_path / "out").glob("hs_*.safetensors"))  # nothing bad written under stop
