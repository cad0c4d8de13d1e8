"""Per-layer statistics of captured states (RMS, max |x|, zero fraction, non-finite count); collapse alarms.

`token_stats` runs where the step tensor is (the GPU, before the copy): [T, L, 4] float32 per-token sums.
`RunStats` (pure) keeps the run's totals per layer id and says when a layer collapses or explodes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PER_FILE = "layer_stats.jsonl"
#: The run's first files set each layer's baseline.
BASELINE_FILES = 3
#: A layer whose RMS or non-zero fraction falls this many times below its baseline (or to 0) collapsed;
#: one whose RMS grows this many times above it exploded.
COLLAPSE_FACTOR = 10.0


def token_stats(hidden: torch.Tensor) -> torch.Tensor:
    """Per token and layer slot [T, L, 4] float32 of a [T, L, H] capture: Σx², max |x|, #zeros, #non-finite;
    computed on hidden's device. A row holding a NaN/Inf gives 0 for Σx² and max |x| (its count says so)."""
    import torch

    # reductions only, no float copy of the states: the GPU keeps its memory for the engine
    sumsq = torch.linalg.vector_norm(hidden, ord=2, dim=-1, dtype=torch.float32).square()
    lo, hi = torch.aminmax(hidden, dim=-1)
    max_abs = torch.maximum(hi.float(), lo.float().neg())
    non_finite = hidden.shape[-1] - torch.isfinite(hidden).sum(dim=-1, dtype=torch.float32)
    zeros = (hidden == 0).sum(dim=-1, dtype=torch.float32)
    ok = non_finite == 0
    none = sumsq.new_zeros(())
    return torch.stack(
        [torch.where(ok, sumsq, none), torch.where(ok, max_abs, none), zeros, non_finite], dim=-1
    )


def flags_from_stats(stats: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """token_flags ([T, 2] bool: all finite, any non-zero) from token_stats rows: no pass over the states."""
    import torch

    finite = stats[..., 3].sum(dim=-1) == 0
    nonzero = (stats[..., 2] < hidden_size).any(dim=-1)
    return torch.stack([finite, nonzero], dim=1)


def step_stats(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """token_stats and flags_from_stats of one step's [T, L, H] rows."""
    stats = token_stats(rows)
    return stats, flags_from_stats(stats, rows.shape[-1])


StepStats = Callable[["torch.Tensor"], tuple["torch.Tensor", "torch.Tensor"]]


def fused_step_stats(sample: torch.Tensor, force: bool = False) -> tuple[StepStats, str]:
    """step_stats compiled into fused kernels for tensors like sample (CUDA; any device with force), with
    how it runs: 'compiled', or 'eager: <why>' when compiling fails or gives other values than eager.

    One pass over the step instead of four (docs/benchmarks.md); shapes are dynamic, so one compile serves.
    """
    import torch

    if sample.device.type != "cuda" and not force:
        return step_stats, f"eager: {sample.device.type} device"
    try:
        fused = torch.compile(step_stats, dynamic=True)
        probe = sample.clone()
        probe.view(-1)[:: max(probe.numel() // 7, 1)] = 0  # zeros and a NaN row exercise every column
        probe[0, 0, 0] = float("nan")
        got, want = fused(probe), step_stats(probe)
        pairs = zip(got, want, strict=True)
        if not all(torch.allclose(g.float(), w.float(), rtol=1e-4, atol=1e-3) for g, w in pairs):
            return step_stats, "eager: the compiled statistics differed from eager ones"
    except Exception as e:  # no compiler/Triton here: correct but slower
        return step_stats, f"eager: compiling failed ({type(e).__name__}: {str(e)[:200]})"
    return fused, "compiled"


def warm_sizes(max_tokens: int) -> list[int]:
    """Token counts to run the compiled statistics on before the first step: the largest step, one that is
    not a multiple of 16 and a single token (Triton and dynamo specialise on those), largest first."""
    sizes = [max_tokens, max_tokens - 1 if max_tokens % 16 == 0 else max_tokens - max_tokens % 16, 1]
    return sorted({n for n in sizes if n >= 1}, reverse=True)


def warm(fn: StepStats, sample: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """Run fn once per token count (rows like sample) and wait for it; ms per size, for the milestone.

    A new size's compile and tuning happen at its first call: here, at setup, not inside the first step.
    """
    import time

    import torch

    took = {}
    # under inference mode, as vLLM runs its steps: dynamo guards on it (and on inference tensors), so a
    # warm-up outside it compiles a graph the steps never use (the first step would compile again)
    with torch.inference_mode():
        for n in sizes:
            rows = torch.zeros((n, *sample.shape[1:]), dtype=sample.dtype, device=sample.device)
            t0 = time.perf_counter()
            fn(rows)
            if rows.device.type == "cuda":
                torch.cuda.synchronize(rows.device)
            took[n] = round(1000 * (time.perf_counter() - t0), 1)
            del rows
    return took


def maybe_token_stats(hidden: torch.Tensor) -> torch.Tensor | None:
    """token_stats of a capture that may not be [T, L, H] (a fault): None then (its shape check says why)."""
    return token_stats(hidden) if hidden.dim() == 3 and hidden.is_floating_point() else None


def file_stats(stats: torch.Tensor, hidden_size: int) -> list[dict[str, float]]:
    """One sample's per-slot sums from its [T, L, 4] token_stats rows (sumsq, max_abs, zeros, non_finite, n,
    finite_n: the values in rows without a NaN/Inf, the RMS's denominator)."""
    total = stats.sum(dim=0)  # [L, 4]
    peak = stats[:, :, 1].amax(dim=0) if stats.shape[0] else total[:, 1]
    finite_rows = (stats[:, :, 3] == 0).sum(dim=0)
    n = float(stats.shape[0] * hidden_size)
    return [
        {
            "sumsq": float(t[0]),
            "max_abs": float(m),
            "zeros": float(t[2]),
            "non_finite": float(t[3]),
            "n": n,
            "finite_n": float(rows * hidden_size),
        }
        for t, m, rows in zip(total.tolist(), peak.tolist(), finite_rows.tolist(), strict=True)
    ]


def summary(sums: dict[str, float]) -> dict[str, float | int]:
    """The user-facing values of sums: rms, max_abs, zero_fraction, non_finite."""
    n = sums["n"]
    finite_n = sums["finite_n"]
    return {
        "rms": math.sqrt(sums["sumsq"] / finite_n) if finite_n > 0 else 0.0,
        "max_abs": sums["max_abs"],
        "zero_fraction": sums["zeros"] / n if n else 0.0,
        "non_finite": int(sums["non_finite"]),
    }


def _add(into: dict[str, float], sums: dict[str, float]) -> None:
    for key in ("sumsq", "zeros", "non_finite", "n", "finite_n"):
        into[key] = into.get(key, 0.0) + sums[key]
    into["max_abs"] = max(into.get("max_abs", 0.0), sums["max_abs"])


@dataclass
class RunStats:
    """Totals per layer id over the run, per-file values, baselines and collapse findings (pure)."""

    layer_ids: list[int]
    totals: dict[int, dict[str, float]] = field(default_factory=dict)
    since: dict[int, dict[str, float]] = field(default_factory=dict)  # since the last progress line
    baseline: dict[int, list[dict[str, float | int]]] = field(default_factory=dict)
    flagged: set[tuple[int, str]] = field(default_factory=set)
    #: each layer's baseline means (rms, non-zero fraction), fixed once its baseline files are in
    means: dict[int, tuple[float, float]] = field(default_factory=dict)

    def add(self, per_slot: list[dict[str, float]]) -> list[dict[str, Any]]:
        """Fold one file's per-slot sums in; returns new findings [{layer, what, message}] (each once)."""
        found: list[dict[str, Any]] = []
        for layer, sums in zip(self.layer_ids, per_slot, strict=False):
            _add(self.totals.setdefault(layer, {}), sums)
            _add(self.since.setdefault(layer, {}), sums)
            values = summary(sums)
            base = self.baseline.setdefault(layer, [])
            if len(base) < BASELINE_FILES:
                base.append(values)
                if len(base) == BASELINE_FILES:
                    self.means[layer] = baseline_means(base)
                continue
            for what, message in judge(values, self.means[layer]):
                if (layer, what) not in self.flagged:
                    self.flagged.add((layer, what))
                    found.append({"layer": layer, "what": what, "message": f"layer {layer}: {message}"})
        return found

    def take_recent(self) -> dict[str, float]:
        """RMS per layer id over the files since the last call (for the progress line and its chart)."""
        out = {str(k): round(float(summary(v)["rms"]), 6) for k, v in self.since.items() if v.get("n")}
        self.since = {}
        return out

    def to_manifest(self) -> dict[str, dict[str, float | int]]:
        """manifest.json's "layer_stats": per layer id over the run (values: how many were summarised)."""
        return {str(k): {**summary(v), "values": int(v["n"])} for k, v in self.totals.items() if v.get("n")}


def baseline_means(base: list[dict[str, float | int]]) -> tuple[float, float]:
    """The baseline files' mean RMS and mean non-zero fraction."""
    rms0 = sum(float(b["rms"]) for b in base) / len(base)
    nz0 = sum(1.0 - float(b["zero_fraction"]) for b in base) / len(base)
    return rms0, nz0


def judge(values: dict[str, float | int], means: tuple[float, float]) -> list[tuple[str, str]]:
    """Collapse / explosion of one file's values against the baseline files' means (baseline_means; pure)."""
    rms0, nz0 = means
    rms, nz = float(values["rms"]), 1.0 - float(values["zero_fraction"])
    out: list[tuple[str, str]] = []
    if rms0 > 0 and (rms == 0 or rms * COLLAPSE_FACTOR <= rms0):
        out.append(("collapse", f"RMS fell to {rms:.3g} from {rms0:.3g} in the run's first files"))
    elif nz0 > 0 and (nz == 0 or nz * COLLAPSE_FACTOR <= nz0):
        out.append(
            ("collapse", f"non-zero fraction fell to {nz:.3g} from {nz0:.3g} in the run's first files")
        )
    if rms0 > 0 and rms >= rms0 * COLLAPSE_FACTOR:
        out.append(("explode", f"RMS grew to {rms:.3g} from {rms0:.3g} in the run's first files"))
    return out


def append_files(
    out_dir: str | Path, layer_ids: list[int], files: list[tuple[int, list[dict[str, float]]]]
) -> None:
    """The layer_stats.jsonl lines of several files (idx, per-slot sums), in one append: each line
    {"idx", "layers": {id: {rms, max_abs, zero_fraction, non_finite}}}."""
    if not files:
        return
    lines = [
        json.dumps(
            {"idx": idx, "layers": {str(k): summary(v) for k, v in zip(layer_ids, per_slot, strict=False)}},
            separators=(",", ":"),
        )
        for idx, per_slot in files
    ]
    with (Path(out_dir) / PER_FILE).open("a", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
