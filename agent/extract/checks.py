"""In-process checks of one captured sample before it is written: shapes (agent's pure checker) plus values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:  # the pure checker (owner C); the facade may re-export it as agent.outputs
    from agent.outputs import Expectation, check_shapes
except ImportError:  # pragma: no cover - depends on the other helper's module layout
    from agent.output_shapes import Expectation, check_shapes

if TYPE_CHECKING:
    import torch

FAULTS = ("drop_layer", "flatten", "zero")


@dataclass(frozen=True)
class Finding:
    """One problem found in a sample (code from DESIGN.md's problem codes)."""

    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        """Plain dict for RPC results and milestone fields."""
        return {"code": self.code, "message": self.message}


def st_dtype(dtype: Any) -> str:
    """safetensors spelling of a torch dtype (torch.bfloat16 -> 'BF16')."""
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64"}.get(
        str(dtype).removeprefix("torch."), str(dtype).upper()
    )


def apply_fault(hidden: torch.Tensor, fault: str | None) -> torch.Tensor:
    """Corrupt a [T, L, H] capture the way real runs went wrong (demo and tests only)."""
    if fault is None:
        return hidden
    if fault == "drop_layer":  # the final layer silently dropped
        return hidden[:, :-1].contiguous()
    if fault == "flatten":  # hidden dimension lost: one scalar per token and layer
        return hidden[:, :, 0].contiguous()
    if fault == "zero":  # all-zero states written silently
        return hidden.new_zeros(hidden.shape)
    raise ValueError(f"unknown fault {fault!r}; expected one of {FAULTS}")


def check_sample(
    file: str,
    token_ids: torch.Tensor,
    hidden: torch.Tensor,
    prompt: list[int],
    layers: int,
    hidden_size: int,
) -> list[Finding]:
    """Shape problems (layer count, [T, H], T == tokens sent) then values (ids == prompt, finite, not zero)."""
    import torch

    expect = Expectation(layers=layers, hidden_size=hidden_size)
    problems = check_shapes(
        file,
        tuple(token_ids.shape),
        tuple(hidden.shape),
        st_dtype(hidden.dtype),
        expect,
        st_dtype(token_ids.dtype),
    )
    found = [Finding(p.code, p.message) for p in problems]
    if token_ids.numel() != len(prompt) or token_ids.tolist() != list(prompt):
        found.append(
            Finding(
                "seq_len_mismatch",
                f"token_ids ({token_ids.numel()} tokens) differ from the prompt sent ({len(prompt)})",
            )
        )
    if hidden.numel() and hidden.is_floating_point():
        bad = int((~torch.isfinite(hidden)).sum())
        if bad:
            found.append(Finding("non_finite", f"{bad} NaN/Inf values in hidden_states"))
        elif not bool(hidden.any()):
            found.append(Finding("all_zero", "hidden_states is all zeros"))
    return found
