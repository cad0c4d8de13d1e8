"""Canary re-capture: a few samples captured again alone (batch size 1), compared with their batched capture.

How it is judged and why the median token: docs/extraction.md ("Canary"). Measured: a random-weight
Kimi-like model, bf16 against float32, differs by 0.22 over its whole 4th-layer slot, 0.054 for its median
token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

CANARY_KEY = "eaglewatch_canary"  # in SamplingParams.extra_args: capture for comparison, do not write
#: Median per-token relative L2 error allowed between a batched capture and the same prompt alone. Unit
#: roundoff is 2^-24 (float32), 2^-11 (float16), 2^-8 (bfloat16); differences compound over the layers, so the
#: bounds sit well above what reordering gives (bf16's above the 0.054 of bf16 against float32 above) and far
#: below a misattributed token (relative error ~1).
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 1e-1}
T = TypeVar("T")


def tolerance(dtype: str) -> float:
    """The canary tolerance of a dtype name ('torch.bfloat16', 'float32'); bf16's for one not listed."""
    return TOLERANCE.get(dtype.removeprefix("torch."), TOLERANCE["bfloat16"])


def end_batch(items: Sequence[T], batch_size: int) -> list[T] | None:
    """The batch the end-of-run canary checks: the last one, or the one before a last batch of one (which
    was captured alone already); None for a run of one batch (the first-batch canary covered it)."""
    if len(items) <= batch_size:
        return None
    start = (len(items) - 1) // batch_size * batch_size
    last = list(items[start:])
    return last if len(last) > 1 else list(items[start - batch_size : start])


def pick(items: Sequence[T], k: int) -> list[T]:
    """k items spread over a batch (first, last, then evenly between); all of them when k ≥ len."""
    if k >= len(items):
        return list(items)
    if k <= 0:
        return []
    if k == 1:
        return [items[0]]
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)]


def rel_diff(batched: torch.Tensor, alone: torch.Tensor) -> float | None:
    """Max over layer slots of the median over tokens of ||batched - alone|| / ||alone|| (per token) of
    [T, L, H] tensors; None if shapes differ, inf if either holds a NaN or Inf (a mismatch)."""
    import torch

    if batched.shape != alone.shape or batched.dim() != 3:
        return None
    a, b = alone.float(), batched.float()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return float("inf")
    diff = torch.linalg.vector_norm(b - a, dim=2)
    ref = torch.linalg.vector_norm(a, dim=2).clamp_min(1e-12)
    return float(torch.quantile(diff / ref, 0.5, dim=0).max())


def compare_with_file(path: Path, alone: torch.Tensor) -> float | None:
    """rel_diff of the batched capture written at path against the capture made alone; None if unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        batched = load_file(str(path))["hidden_states"]
    except (OSError, KeyError, SafetensorError):
        return None
    return rel_diff(batched, alone.to(batched.dtype))


def verdict(diffs: Sequence[float | None], dtype: str) -> dict[str, Any]:
    """The canary_checked fields: samples compared, max_rel_diff, ok, tolerance (pure)."""
    got = [d for d in diffs if d is not None]
    worst = max(got) if got else None
    tol = tolerance(dtype)
    return {"samples": len(got), "max_rel_diff": worst, "ok": worst is None or worst <= tol, "tolerance": tol}
