"""HF transformers reference residual stream: index k = entering layer k, N = final pre-norm output."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_states(model_dir: Path, samples: list[list[int]], layer_ids: list[int]) -> list[torch.Tensor]:
    """[T, len(layer_ids), H] float32 per sample, computed one sample at a time by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    layers = model.model.layers
    n = len(layers)
    last: list[torch.Tensor] = []

    def grab(_m: torch.nn.Module, _a: object, out: object) -> None:
        last.append(out[0] if isinstance(out, tuple) else out)  # type: ignore[arg-type]

    handle = layers[n - 1].register_forward_hook(grab)
    out = []
    try:
        with torch.no_grad():
            for ids in samples:
                last.clear()
                res = model(torch.tensor([ids]), output_hidden_states=True)
                per = [last[0][0] if k == n else res.hidden_states[k][0] for k in layer_ids]
                out.append(torch.stack(per, dim=1))
    finally:
        handle.remove()
    return out


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (one scale for the tensor: robust near zero entries)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def same_capture(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Two float32 captures of the same prompt by two engines: the same shape and values up to rounding (on
    some CPUs, AMX ones among them, vLLM's kernels sum in another order from one engine start to the next)."""
    return got.shape == want.shape and max_rel_err(got, want) < 1e-4
