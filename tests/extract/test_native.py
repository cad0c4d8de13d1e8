"""vllm-native backend on the real vLLM CPU engine: extract_hidden_states + our connector (synchronous CPU
write, loaded through kv_connector_module_path), against the same HF reference as the Llama test, with
layer ids in the "output" convention."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.extract.jobrun import run_job, write_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

LENGTHS = [7, 33, 1, 50, 12]
LAYERS = [1, 3, 4, 7]  # "output" convention: leaving layer k == entering layer k + 1 (vLLM's aux ids)
REF_LAYERS = [2, 4, 5, 8]


def test_native_backend_equals_hf_reference(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from agent.extract.tinymodel import build
    from tests.extract.reference import hf_states, max_rel_err

    model = build(tmp_path / "model", "llama", seed=4)
    rng = random.Random(3)
    samples = [[rng.randrange(4, 500) for _ in range(n)] for n in LENGTHS]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in samples))
    out = tmp_path / "out"
    spec = write_spec(
        tmp_path / "spec.json",
        backend="vllm-native",
        model=str(model),
        dataset=str(data),
        output_dir=str(out),
        layers=LAYERS,
        layer_convention="output",
        batch_size=len(LENGTHS),
        vllm_args=["--dtype", "float32", "--max-num-batched-tokens", "24", "--max-num-seqs", "5"],
    )
    job = run_job(spec)
    assert job.rc == 0, job.output[-3000:]
    conf = job.of("capture_configured")[0]
    assert conf["convention"] == "output" and conf["layers"] == LAYERS
    assert conf["backend"] == "vllm-native" and conf["layer_class"] == "EagleWatchHiddenStatesConnector"
    assert len(job.of("shape_check_passed")) == len(LENGTHS)
    # the canary for this backend: two samples captured alone through vLLM's connector, compared with files
    (canary_ms,) = job.of("canary_checked")
    assert canary_ms["when"] == "first batch" and canary_ms["samples"] == 2 and canary_ms["ok"] is True
    assert canary_ms["max_rel_diff"] is not None and canary_ms["max_rel_diff"] <= 1e-3
    # only hs_N, the manifest and the per-file statistics remain: staging dir and .lock files are cleaned up
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"hs_{i}.safetensors" for i in range(len(LENGTHS))] + ["manifest.json", "layer_stats.jsonl"]
    )
    # per-layer statistics for this backend too (read from the connector's files): RMS over the run
    stats = json.loads((out / "manifest.json").read_text())["layer_stats"]
    for j, k in enumerate(LAYERS):
        files = [load_file(str(out / f"hs_{i}.safetensors")) for i in range(len(LENGTHS))]
        states = torch.cat([f["hidden_states"][:, j] for f in files])
        rms = float(states.double().square().mean().sqrt())
        assert abs(stats[str(k)]["rms"] - rms) <= 1e-4 * rms and stats[str(k)]["non_finite"] == 0
    refs = hf_states(model, samples, REF_LAYERS)
    for i, (ids, ref) in enumerate(zip(samples, refs, strict=True)):
        got = load_file(str(out / f"hs_{i}.safetensors"))
        assert got["token_ids"].tolist() == ids
        assert got["hidden_states"].dtype == torch.float32
        assert tuple(got["hidden_states"].shape) == (len(ids), len(LAYERS), 128)
        for j, k in enumerate(LAYERS):
            err = max_rel_err(got["hidden_states"][:, j], ref[:, j])
            assert err < 1e-4, f"sample {i} layer id {k}: rel err {err:.2e}"
