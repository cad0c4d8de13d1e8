"""Token attribution under vLLM's two model runners, driven through the worker extension's own hooks.

vLLM's Model Runner V2 needs Triton on a GPU (on this CPU vLLM refuses it: "Model Runner V2 requires
Triton"), so the V2 runner below is a stand-in: it exposes what V2 exposes in vLLM 0.26 and 0.32 (a
`prepare_inputs` that returns an InputBatch whose `req_ids` are sorted decode → short → long, and
`req_states`) and runs real torch modules with the extension's real hooks into a real sink writing real
files (through the writer process). The real V2 runner is exercised on the H200 (tests/gpu/validation.md).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from agent.extract.capture.assembly import SinkConfig
from agent.extract.capture.worker_ext import EagleWatchCapture, plan_hooks, runner_kind
from agent.extract.writing.writer_proc import ProcessSink

H = 4
LAYERS = [1, 2, 3]  # input convention over 3 layers: id 3 is the output of the last one


class AddOne(nn.Module):
    """A decoder layer stand-in named like one: adds 1 to every hidden value."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Any) -> Any:
        return hidden_states + 1, residual


class FakeV2Runner:
    """What vLLM's V2 GPUModelRunner offers the extension: prepare_inputs → batch.req_ids, req_states."""

    def __init__(self) -> None:
        self.req_states = object()
        self.layers = nn.ModuleList([AddOne() for _ in range(3)])
        self.prompts: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def prepare_inputs(self, so: Any, batch_desc: Any = None) -> Any:
        n = so.num_scheduled_tokens
        return SimpleNamespace(req_ids=sorted(n, key=lambda r: (n[r] != 1, n[r])))

    def execute_model(self, so: Any, intermediate_tensors: Any = None) -> None:
        batch = self.prepare_inputs(so, None)
        rows = []
        for rid in batch.req_ids:
            start = self.computed.get(rid, 0)
            rows += [float(self.prompts[rid][t]) for t in range(start, start + so.num_scheduled_tokens[rid])]
            self.computed[rid] = start + so.num_scheduled_tokens[rid]
        hidden = torch.tensor(rows).unsqueeze(1).repeat(1, H)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(torch.zeros(len(rows)), hidden, residual)


def _new(rid: str, idx: int, prompt: list[int]) -> Any:
    return SimpleNamespace(
        req_id=rid,
        num_computed_tokens=0,
        sampling_params=SimpleNamespace(extra_args={"eaglewatch_idx": idx}),
        prompt_token_ids=prompt,
    )


def _step(scheduled: dict[str, int], new: list[Any], cached: dict[str, int]) -> Any:
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(scheduled.values()),
        num_scheduled_tokens=scheduled,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), num_computed_tokens=list(cached.values())
        ),
    )


def test_v2_order_comes_from_prepare_inputs_not_the_scheduler(tmp_path: Path) -> None:
    runner = FakeV2Runner()
    ext = EagleWatchCapture()
    ext.model_runner = runner  # type: ignore[attr-defined]
    ext._ew_init(runner_kind(runner), len(LAYERS), ProcessSink(SinkConfig(str(tmp_path), len(LAYERS), H)))
    for li, where, slot in plan_hooks(LAYERS, "input", 3):
        if where == "pre":
            runner.layers[li].register_forward_pre_hook(
                functools.partial(ext._ew_pre, slot), with_kwargs=True
            )
        else:
            runner.layers[li].register_forward_hook(functools.partial(ext._ew_post, slot))
    ext._ew_wrap_runner(runner, "v2")
    prompts = {"a": [10, 11, 12, 13, 14], "b": [20, 21, 22], "c": [30, 31, 32, 33, 34, 35, 36, 37, 38]}
    runner.prompts = prompts
    # step 1: a whole (5) and c's first 4 — V2 runs c first (fewer tokens); step 2: rest of c (5), b (3)
    runner.execute_model(
        _step({"a": 5, "c": 4}, [_new("a", 0, prompts["a"]), _new("c", 2, prompts["c"])], {})
    )
    runner.execute_model(_step({"c": 5, "b": 3}, [_new("b", 1, prompts["b"])], {"c": 4}))
    assert ext._ew_sink is not None
    results = sorted(ext._ew_sink.drain(), key=lambda r: r["idx"])
    ext._ew_sink.close()
    assert [(r["idx"], r["tokens"], r["problems"]) for r in results] == [(0, 5, []), (1, 3, []), (2, 9, [])]
    for idx, rid in enumerate("abc"):
        got = load_file(str(tmp_path / f"hs_{idx}.safetensors"))
        assert got["token_ids"].tolist() == prompts[rid]
        # entering layer k, a token's value is its prompt id plus k (each layer adds one)
        want = torch.tensor([[[float(t + k)] * H for k in LAYERS] for t in prompts[rid]])
        assert torch.equal(got["hidden_states"], want), f"sample {idx} attributed wrongly"


def test_runner_kinds() -> None:
    assert runner_kind(SimpleNamespace(input_batch=SimpleNamespace(req_ids=[]))) == "v1"
    assert runner_kind(FakeV2Runner()) == "v2"
    pcp = FakeV2Runner()
    pcp.pcp_manager = object()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="prefill context parallelism"):
        runner_kind(pcp)
    with pytest.raises(RuntimeError, match=r"SimpleNamespace has neither .* VLLM_USE_V2_MODEL_RUNNER=0"):
        runner_kind(SimpleNamespace(execute_model=None))
