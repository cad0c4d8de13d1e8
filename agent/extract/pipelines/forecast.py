"""Forecasts for the users' own pipelines: bytes from speculators' and SpecForge's documented file layouts.

The layouts and how each tool picks its rows: docs/extraction.md ("speculators and SpecForge"). SpecForge
applies a chat template, so its token counts here are estimates (never above ``--max-length``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.backends import Backend
from agent.extract.pipelines.plan import capture_layers
from agent.extract.planning.forecast import (
    SAMPLE_ROWS,
    Forecast,
    count_rows,
    element_bytes,
    file_bytes,
    forecast_sizes,
    free_bytes,
    picked_rows,
    sample_indices,
    spec_dtype,
)
from agent.extract.planning.preflight import SpecError, text_config
from agent.spec import RunSpec, SpecForgeOptions, SpeculatorsOptions

#: torch.save's zip archive around SpecForge's four tensors: entry headers, the pickled dict, alignment.
CKPT_OVERHEAD_BYTES = 2560
SPECFORGE_ID_BYTES = 16  # input_ids and loss_mask, int64 each
#: Chat-template tokens per conversation turn (role markers, separators) on top of the content's tokens.
TEMPLATE_TOKENS_PER_TURN = 8


def specforge_file_bytes(tokens: int, hidden: int, elt: int) -> int:
    """Size of one SpecForge data_i.ckpt of `tokens` tokens: ids, mask, hidden_state and 3×hidden aux."""
    return CKPT_OVERHEAD_BYTES + tokens * (SPECFORGE_ID_BYTES + 4 * hidden * elt)


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value of `--flag V` or `--flag=V` in argv (argparse keeps the last), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def int_flag(argv: Sequence[str], flag: str, default: int | None) -> int | None:
    """flag_value as a non-negative int; SpecError naming the flag when it is not one."""
    raw = flag_value(argv, flag)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SpecError(f"{flag} must be an integer, got {raw!r}") from None
    if value < 0:
        raise SpecError(f"{flag} must not be negative, got {value}")
    return value


def rank_window(target: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the rows one speculators client rank takes: chunks differing by at most one."""
    chunk, rest = divmod(target, world_size)
    start = rank * chunk + min(rank, rest)
    return start, start + chunk + (1 if rank < rest else 0)


def existing_indices(out: Path, prefix: str, suffix: str) -> set[int]:
    """Indices i of files `{prefix}{i}{suffix}` directly in out (none when out does not exist yet)."""
    found: set[int] = set()
    if out.is_dir():
        for p in out.iterdir():
            mid = p.name.removeprefix(prefix).removesuffix(suffix)
            if p.name.startswith(prefix) and p.name.endswith(suffix) and mid.isdigit():
                found.add(int(mid))
    return found


def speculators_lengths(path: Path, indices: list[int]) -> list[int]:
    """Token counts of the given rows of a dataset saved by `datasets` (seq_len, else len(input_ids))."""
    ds: Any = load_dataset(path).with_format(None)
    if "seq_len" not in ds.column_names and "input_ids" not in ds.column_names:
        raise SpecError(f"dataset {path} has no input_ids column (columns: {ds.column_names})")
    if not indices:
        return []
    rows = ds.select(indices)
    if "seq_len" in ds.column_names:
        return [int(n) for n in rows["seq_len"]]
    return [len(ids) for ids in rows["input_ids"]]


def dataset_rows(path: Path) -> int:
    """Rows of a dataset saved by `datasets` (its length), SpecError when it cannot be read."""
    if not path.is_dir():
        raise SpecError(f"dataset {path} is not a directory saved by datasets' save_to_disk")
    return len(load_dataset(path))


def load_dataset(path: Path) -> Any:
    """A dataset saved by `datasets`' save_to_disk; SpecError when the package or the dataset is missing."""
    try:
        from datasets import load_from_disk
    except ImportError:  # the agent's Python on a GPU host need not have it
        raise SpecError("reading speculators' --preprocessed-data needs the datasets package") from None
    try:
        return load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise SpecError(f"dataset {path} is not a dataset saved by datasets' save_to_disk: {e}") from None


def forecast_speculators(spec: RunSpec) -> Forecast:
    """What speculators' client will still write for this spec (this rank's rows without a file yet)."""
    opts = spec.speculators or SpeculatorsOptions()
    cfg = text_config(Path(spec.model or ""))
    layers = len(capture_layers(spec, int(cfg["num_hidden_layers"])))
    args = opts.client_args
    # a path given again among the tool's own flags wins there (argparse and typer keep the last)
    data = Path(flag_value(args, "--preprocessed-data") or spec.dataset or "")
    out = Path(flag_value(args, "--output") or spec.output_dir or "")
    rows = dataset_rows(data)
    limit = int_flag(args, "--max-samples", spec.max_samples)
    world = int_flag(args, "--world-size", 1) or 1
    rank = int_flag(args, "--rank", 0) or 0
    if rank >= world:
        raise SpecError(f"--rank {rank} must be below --world-size {world}")
    start, end = rank_window(min(rows, limit) if limit is not None else rows, world, rank)
    done = existing_indices(out, "hs_", ".safetensors")
    todo = [i for i in range(start, end) if i not in done]
    picked = [todo[i] for i in sorted(sample_indices(len(todo)))]
    counts = speculators_lengths(data, picked)
    elt = element_bytes(spec_dtype(spec, cfg))
    hidden = int(cfg["hidden_size"])
    return forecast_sizes(counts, len(todo), lambda t: file_bytes(t, layers, hidden, elt), free_bytes(out))


def conversation_texts(row: dict[str, Any]) -> list[str] | None:
    """The turns' texts of one SpecForge JSONL row ("conversations" of role/content or from/value)."""
    turns = row.get("conversations")
    if not isinstance(turns, list):
        return None
    texts = []
    for turn in turns:
        if isinstance(turn, dict):
            text = turn.get("content", turn.get("value"))
            texts.append(text if isinstance(text, str) else "")
    return texts


def specforge_counts(path: Path, model_dir: Path, max_length: int, rows: int) -> list[int]:
    """Estimated token counts of sampled rows: the turns' tokens plus template tokens, capped at max_length.

    Rows that already carry input_ids count those; without a loadable tokenizer, or for a row of another
    shape, a row counts max_length.
    """
    tokenizer: Any = None
    counts: list[int] = []
    for row in picked_rows(path, rows, set(sample_indices(rows, SAMPLE_ROWS))):
        ids = row.get("input_ids") if isinstance(row, dict) else None
        texts = conversation_texts(row) if isinstance(row, dict) else None
        if isinstance(ids, list):
            counts.append(min(len(ids), max_length))
        elif texts is not None:
            if tokenizer is None:
                tokenizer = _tokenizer(model_dir)
            if tokenizer is False:
                counts.append(max_length)
                continue
            used = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
            counts.append(min(used + TEMPLATE_TOKENS_PER_TURN * len(texts), max_length))
        else:  # a row shape not known here: the most SpecForge keeps of any row
            counts.append(max_length)
    return counts


def _tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer, or False when it cannot be loaded here (counts fall back to max_length)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except (ImportError, OSError, ValueError):
        return False


def forecast_specforge(spec: RunSpec) -> Forecast:
    """What SpecForge's prepare_hidden_states.py will write for this spec (always estimated)."""
    opts: SpecForgeOptions | None = spec.specforge
    args = opts.args if opts is not None else []
    model_dir = Path(flag_value(args, "--target-model-path") or spec.model or "")
    data = Path(flag_value(args, "--data-path") or spec.dataset or "")
    cfg = text_config(model_dir)
    if not data.is_file():
        raise SpecError(f"dataset {data} does not exist")
    limit = int_flag(args, "--num-samples", spec.max_samples)
    max_length = int_flag(args, "--max-length", spec.seq_len) or spec.seq_len
    rows = count_rows(data, limit)
    counts = specforge_counts(data, model_dir, max_length, rows)
    elt = element_bytes(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))
    hidden = int(cfg["hidden_size"])
    size = lambda t: specforge_file_bytes(t, hidden, elt)  # noqa: E731
    out = flag_value(args, "--output-path") or spec.output_dir or "/"
    return forecast_sizes(counts, rows, size, free_bytes(out), estimated=True)


def forecast_pipeline(spec: RunSpec) -> Forecast:
    """The forecast of a validated spec of backend speculators or specforge; starts nothing."""
    if spec.backend == Backend.SPECULATORS:
        return forecast_speculators(spec)
    return forecast_specforge(spec)


def specforge_total(spec: RunSpec) -> int | None:
    """Rows SpecForge will process (the JSONL's non-empty lines, at most --num-samples), None if unknown."""
    args = spec.specforge.args if spec.specforge is not None else []
    data = Path(flag_value(args, "--data-path") or spec.dataset or "")
    try:
        limit = int_flag(args, "--num-samples", spec.max_samples)
        return count_rows(data, limit) if data.is_file() else limit
    except (SpecError, OSError):
        return None
