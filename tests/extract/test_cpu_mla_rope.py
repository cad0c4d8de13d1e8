"""Why tiny DeepSeek-V3 on vLLM-CPU differs from HF transformers by a few percent (positions >= 1 only).

MLA calls the rotary embedding with the query's rope part as a 3-D multi-head view, `q[..., nope:]` of
[T, H, qk_head_dim]. vllm-cpu 0.32.0's CPU kernel (RotaryEmbedding.forward_cpu -> ops.rotary_embedding,
GPT-J style) rotates that layout wrongly, while the flattened [T, H*D] layout Llama uses and the
single-head key [T, 1, D] come out right. A wrong q_pe only changes attention scores, and the softmax over
a single key ignores scores, which is why position 0 still matched. Strict xfail: it starts failing
(passing) when vLLM fixes the kernel, and then the DeepSeek test can compare against HF directly.
"""

from __future__ import annotations

from typing import Any

import pytest

# importing vLLM in-process pulls torch.jit deprecation warnings (not ours) through torch.utils.mkldnn
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _rope() -> Any:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(
            64,
            max_position=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            is_neox_style=False,
        )


def test_cpu_rope_is_right_for_flat_and_single_head_layouts() -> None:
    import torch

    rope = _rope()
    pos = torch.arange(6)
    q, k = torch.randn(6, 4, 64), torch.randn(6, 1, 64)
    want_q, want_k = rope.forward_native(pos, q.clone(), k.clone())
    got_q, got_k = rope.forward_cpu(pos, q.clone().reshape(6, 256), k.clone())
    assert torch.allclose(got_q.reshape(6, 4, 64), want_q, atol=1e-5)
    assert torch.allclose(got_k, want_k, atol=1e-5)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="vllm-cpu 0.32.0 CPU rotary kernel mishandles 3-D multi-head queries",
)
def test_cpu_rope_on_mla_query_view_matches_native() -> None:
    import torch

    rope = _rope()
    pos = torch.arange(6)
    q, k = torch.randn(6, 4, 96), torch.randn(6, 1, 64)
    want_q, _ = rope.forward_native(pos, q[..., 32:].clone(), k.clone())
    got = q.clone()
    got[..., 32:], _ = rope.forward_cpu(pos, got[..., 32:], k.clone())  # exactly as MLA calls it
    assert torch.allclose(got[..., 32:], want_q, atol=1e-5)
