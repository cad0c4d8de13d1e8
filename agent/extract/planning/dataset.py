"""Samples from a JSONL dataset: `token_ids` lists or `text` (tokenised with the model's tokenizer)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class DatasetError(ValueError):
    """The dataset cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Sample:
    """One prompt: its index in the dataset (the hs_{idx} number) and its token ids (after truncation)."""

    idx: int
    token_ids: tuple[int, ...]


def count(path: str | Path, max_samples: int | None) -> int:
    """M, the samples in the run: non-empty lines, at most max_samples (lines are not parsed here)."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset {p} does not exist")
    n = 0
    with p.open(encoding="utf-8") as fh:  # read as load() reads it, so both see the same lines
        for raw in fh:
            if max_samples is not None and n >= max_samples:
                break
            n += bool(raw.strip())
    return n


def load(
    path: str | Path,
    model_dir: str | Path,
    seq_len: int,
    max_samples: int | None,
    window: tuple[int, int] | None = None,
) -> list[Sample]:
    """Read up to max_samples non-empty lines; truncate each to seq_len tokens.

    window [start, end) keeps only those sample indices (a shard's slice); the others are not parsed,
    so a shard tokenises its own samples only. An empty window gives an empty list.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset {p} does not exist")
    start, end = window if window is not None else (0, max_samples)
    if max_samples is not None:
        end = min(end, max_samples) if end is not None else max_samples
    tokenizer = None
    samples: list[Sample] = []
    idx = -1
    with p.open(encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, 1):
            if end is not None and idx + 1 >= end:
                break
            if not raw.strip():
                continue
            idx += 1
            if idx < start:
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{p}:{lineno}: expected an object with 'token_ids' or 'text'")
            if "token_ids" in row:
                ids = row["token_ids"]
                if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                    raise DatasetError(f"{p}:{lineno}: 'token_ids' must be a list of non-negative integers")
            elif isinstance(row.get("text"), str):
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
                ids = list(tokenizer(row["text"], add_special_tokens=True)["input_ids"])
            else:
                raise DatasetError(f"{p}:{lineno}: expected 'token_ids' (list of ints) or 'text' (string)")
            ids = ids[:seq_len]
            if not ids:
                raise DatasetError(f"{p}:{lineno}: sample has no tokens")
            samples.append(Sample(idx, tuple(ids)))
    if not samples and window is None:
        raise DatasetError(f"dataset {p} has no samples")
    return samples
