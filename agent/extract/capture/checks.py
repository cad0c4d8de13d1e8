"""In-process checks of a captured sample before it is written: shapes (agent's pure checker) + values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.checks.shapes import Expectation, check_shapes

if TYPE_CHECKING:
    import torch

    from agent.spec import Fault

#: zero_layer: layer slot ZERO_LAYER_SLOT reads all zeros from sample ZERO_LAYER_FROM on (the run's first
#: files stay healthy, so the collapse shows against them, as in the hybrid-model bug vllm#46301).
ZERO_LAYER_SLOT, ZERO_LAYER_FROM = 1, 4
#: batch_skew: a capture made beside other requests is scaled by this (relative error 0.25 from alone).
BATCH_SKEW = 1.25


@dataclass(frozen=True)
class Finding:
    """One problem found in a sample (code: one of the stable problem codes, docs/architecture.md)."""

    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        """Plain dict for RPC results and milestone fields."""
        return {"code": self.code, "message": self.message}


def apply_fault(hidden: torch.Tensor, fault: Fault, idx: int = 0, batched: bool = False) -> torch.Tensor:
    """Corrupt a [T, L, H] capture (sample idx; batched: captured beside other requests) the way real runs
    went wrong (demo and tests only)."""
    if fault == "drop_layer":  # the final layer silently dropped
        return hidden[:, :-1].contiguous()
    if fault == "flatten":  # hidden dimension lost: one scalar per token and layer
        return hidden[:, :, 0].contiguous()
    if fault == "zero":  # all-zero states written silently
        return hidden.new_zeros(hidden.shape)
    if fault == "batch_skew":  # states depend on the batch (speculators #279): only batched captures change
        return hidden * BATCH_SKEW if batched else hidden
    # zero_layer: one layer slot collapses to zeros part-way through the run
    if idx < ZERO_LAYER_FROM:
        return hidden
    out = hidden.clone()
    out[:, min(ZERO_LAYER_SLOT, hidden.shape[1] - 1)] = 0
    return out


def token_flags(hidden: torch.Tensor) -> torch.Tensor:
    """Per token [T, 2] bool: (all values finite, any value non-zero); cheap on the GPU before the copy."""
    import torch

    flat = hidden.reshape(hidden.shape[0], -1)
    return torch.stack([torch.isfinite(flat).all(dim=1), (flat != 0).any(dim=1)], dim=1)


def check_sample(
    file: str,
    token_ids: torch.Tensor,
    hidden: torch.Tensor,
    prompt: list[int],
    layers: int,
    hidden_size: int,
    flags: torch.Tensor | None = None,
) -> list[Finding]:
    """Shape problems (layer count, [T, H], T == tokens sent), then values: ids == prompt, finite, not zero.

    flags: token_flags() computed earlier (on the device); None computes them here from hidden.
    """
    expect = Expectation(layers=layers, hidden_size=hidden_size)
    # check_shapes reads torch's dtype spellings ("torch.bfloat16") as safetensors' ("BF16")
    tdt, hdt = str(token_ids.dtype), str(hidden.dtype)
    problems = check_shapes(file, tuple(token_ids.shape), tuple(hidden.shape), hdt, expect, tdt)
    found = [Finding(p.code, p.message) for p in problems]
    if token_ids.numel() != len(prompt) or token_ids.tolist() != list(prompt):
        msg = f"token_ids ({token_ids.numel()} tokens) differ from the prompt sent ({len(prompt)} tokens)"
        found.append(Finding("seq_len_mismatch", msg))
    if hidden.numel() and hidden.is_floating_point():
        if flags is None or flags.shape[0] != hidden.shape[0]:
            flags = token_flags(hidden)
        bad = int((~flags[:, 0]).sum())
        if bad:
            found.append(Finding("non_finite", f"{bad} of {flags.shape[0]} tokens have NaN/Inf states"))
        elif not bool(flags[:, 1].any()):
            found.append(Finding("all_zero", "hidden_states is all zeros"))
    return found
