"""Backend vllm-native: vLLM's `extract_hidden_states` + our connector; the job moves files into place."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import Any

from agent.extract.capture.stats import file_stats, maybe_token_stats
from agent.extract.engine import canary
from agent.extract.engine.driver import (
    Progress,
    batches_done,
    configured,
    handle_results,
    report_canary,
)
from agent.extract.engine.setup import CaptureFailed, engine_kwargs, prepare_engine
from agent.extract.planning.dataset import Sample
from agent.extract.planning.preflight import Plan
from agent.extract.writing.writer import Manifest, sample_path, write_sample

CONNECTOR = "EagleWatchHiddenStatesConnector"
CONNECTOR_MODULE = "agent.extract.engine.native_connector"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"


def native_layer_ids(layer_ids: list[int], convention: str) -> list[int]:
    """vLLM's aux layer ids are in the "input" convention: output id k is input id k + 1."""
    return list(layer_ids) if convention == "input" else [k + 1 for k in layer_ids]


def speculative_config(layers: list[int]) -> dict[str, Any]:
    """vLLM's `extract_hidden_states` method for these layer ids (its "input" convention)."""
    hf_config = {"eagle_aux_hidden_state_layer_ids": layers}
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": hf_config},
    }


def transfer_config(staging: str, stock: bool = False) -> dict[str, Any]:
    """The kv_transfer_config writing each request's states under staging: our connector, or vLLM's own."""
    ours = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE}
    writes = {"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": staging}}
    return {**({"kv_connector": STOCK_CONNECTOR} if stock else ours), **writes}


def _wait_and_load(path: str) -> dict[str, Any]:
    """Block on the connector's `.lock` (shared flock) until the writer released it, then load the file."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as fh:
            fcntl.flock(fh, fcntl.LOCK_SH)
            data = load_file(path, device="cpu")
        os.remove(lock)
        return data
    return load_file(path, device="cpu")


def _finish(plan: Plan, sample: Sample, path: str) -> dict[str, Any]:
    """Check one connector file, then move it (or, with a fault injected, a corrupted copy) to hs_{idx}."""
    from agent.extract.capture.checks import apply_fault, check_sample

    spec = plan.spec
    data = _wait_and_load(path)
    token_ids, hidden = data["token_ids"], data["hidden_states"]
    if spec.inject_fault is not None:
        hidden = apply_fault(hidden, spec.inject_fault)
    name = sample_path(spec.output_dir or ".", sample.idx).name
    prompt = list(sample.token_ids)
    found = check_sample(name, token_ids, hidden, prompt, len(plan.layer_ids), plan.hidden_size)
    written, nbytes = False, 0
    if not (found and spec.on_shape_failure == "stop"):
        if spec.inject_fault is None:
            final = sample_path(spec.output_dir or ".", sample.idx)
            os.replace(path, final)  # same filesystem: staging lives inside output_dir
            nbytes, written = final.stat().st_size, True
        else:
            _, nbytes = write_sample(spec.output_dir or ".", sample.idx, token_ids, hidden)
            written = True
    if os.path.exists(path):
        os.remove(path)
    problems = [f.to_dict() for f in found]
    # vLLM's connector has already copied the states off the device: the statistics come from the file
    token = maybe_token_stats(hidden)
    return {
        "idx": sample.idx,
        "file": name,
        "tokens": len(sample.token_ids),
        "bytes": nbytes,
        "written": written,
        "problems": problems,
        "layer_stats": None
        if token is None or token.shape[1] != len(plan.layer_ids)
        else file_stats(token, plan.hidden_size),
    }


def run_native(plan: Plan, todo: list[Sample], manifest: Manifest, prog: Progress) -> None:
    """Configure extract_hidden_states + our connector, send each batch, check and move every file."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    spec = plan.spec
    out = Path(spec.output_dir or ".")
    staging = tempfile.mkdtemp(prefix=".staging-", dir=out)
    extra, _capture = prepare_engine(plan)
    kwargs = engine_kwargs(str(plan.model_dir), [*spec.vllm_args, *extra])
    kwargs.setdefault("max_model_len", max(len(s.token_ids) for s in todo) + 1)
    kwargs["enable_prefix_caching"] = False  # cached tokens would never reach the aux layers
    if not current_platform.is_cuda():
        kwargs["enforce_eager"] = True  # no CUDA graphs off the GPU; CPU compilation only costs start time
    llm = LLM(
        model=str(plan.model_dir),
        tensor_parallel_size=spec.tensor_parallel_size,
        speculative_config=speculative_config(native_layer_ids(plan.layer_ids, spec.layer_convention)),
        kv_transfer_config=transfer_config(staging),
        **kwargs,
    )
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    manifest.dtype = dtype
    configured(plan, dtype, CONNECTOR)
    prog.restart_clock()
    for start in range(0, len(todo), spec.batch_size):
        batch = todo[start : start + spec.batch_size]
        prompts = [TokensPrompt(prompt_token_ids=list(s.token_ids)) for s in batch]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        results = []
        for sample, output in zip(batch, outputs, strict=True):
            params = output.kv_transfer_params or {}
            path = params.get("hidden_states_path")
            if not path:
                raise CaptureFailed(f"vLLM returned no hidden_states_path for sample {sample.idx}")
            results.append(_finish(plan, sample, path))
        handle_results(results, plan, manifest, prog)
        batches_done([batch], prog)
        if start == 0:
            native_canary(llm, plan, batch, dtype, "first batch")
    end = canary.end_batch(todo, spec.batch_size)
    if end is not None:
        native_canary(llm, plan, end, dtype, "end")
    os.rmdir(staging)


def native_canary(llm: Any, plan: Plan, batch: list[Sample], dtype: str, when: str) -> None:
    """Capture a few samples of a batch again, alone, through vLLM's connector; compare with their files."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    chosen = canary.pick(batch, plan.spec.canary_samples)
    if len(batch) < 2 or not chosen:
        return
    diffs: list[float | None] = []
    for s in chosen:  # one generate call each: nothing else is scheduled beside it
        prompt = TokensPrompt(prompt_token_ids=list(s.token_ids))
        (output,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        path = (output.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise CaptureFailed(f"vLLM returned no hidden_states_path for the canary of sample {s.idx}")
        alone = _wait_and_load(path)["hidden_states"]
        os.remove(path)
        final = sample_path(plan.spec.output_dir or ".", s.idx)
        diffs.append(canary.compare_with_file(final, alone) if final.exists() else None)
    report_canary(plan, diffs, dtype, when)
