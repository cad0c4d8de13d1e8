"""Check captured hidden-state files (or a directory of them) and report problems with stable codes.

A file's format comes from its name, else its first bytes; the rules are pure (shapes.py, formats.py), this
module does the I/O.  ``ok`` is True only when at least one file was checked and no problem was found; files
still being written (a ``.lock`` beside them) are unchecked, not problems.  check_path never raises for
file-system conditions.
"""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.checks import tensorfiles, zstfiles
from agent.checks.dirs import (
    CAPTURE,
    directory_gaps,
    escapes,
    is_capture_file,
    length_problem,
    lock_names,
    read_sample_lengths,
    walk,
)
from agent.checks.formats import SAFETENSORS, SPECULATORS_PT, SPLIT_KEYS, check_sample, classify
from agent.checks.safetensors_header import Header, HeaderError, read_header
from agent.checks.shapes import (
    Expectation,
    Problem,
    TensorMeta,
    check_shapes,
    missing_keys,
    value_problems,
)
from agent.checks.zstfiles import scannable

_NO_VALUES = "value checks (NaN/Inf, all-zero) skipped: numpy is not importable"


@dataclass(frozen=True)
class CheckReport:
    """The result of checking a file or directory: the shape of `eaglewatch-agent check --json`."""

    ok: bool
    files: int
    format: str | None
    problems: list[Problem]
    unchecked: list[str]
    notes: list[str] = field(default_factory=list)
    shapes: dict[str, list[int]] = field(default_factory=dict)  # tensor name: shape, of the last file read

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form: ok, files, format, problems [{code, file, message}], unchecked, notes,
        shapes {tensor name: shape read}."""
        return asdict(self)


@dataclass
class _Result:
    format: str | None
    problems: list[Problem] = field(default_factory=list)
    unchecked: str | None = None  # the reason, when the file could not be checked
    tokens: int | None = None  # T, for the cross-check against sample_lengths.json
    notes: list[str] = field(default_factory=list)
    shapes: dict[str, list[int]] = field(default_factory=dict)  # the header's, beside what was expected


def _first_positive(configs: list[Any], keys: tuple[str, ...]) -> int | None:
    """The first positive integer under one of ``keys`` in the first config dict that has one."""
    for cfg in configs:
        if not isinstance(cfg, dict):
            continue
        for key in keys:
            v = cfg.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def find_hidden_size(config: dict[str, Any]) -> int | None:
    """The language model's hidden size from a config.json dict (text/language config of VL shells first)."""
    nested = [config.get(k) for k in ("text_config", "language_config", "llm_config")]
    thinker = config.get("thinker_config")
    if isinstance(thinker, dict):
        nested.append(thinker.get("text_config"))
    return _first_positive([*nested, config], ("hidden_size", "d_model", "n_embd", "dim"))


def find_kv_lora_rank(config: dict[str, Any]) -> int | None:
    """The MLA latent width (kv_lora_rank) of a DeepSeek-V2-family config.json dict, else None."""
    return _first_positive(
        [config.get("text_config"), config.get("language_config"), config], ("kv_lora_rank",)
    )


def expectation_from_model(model_dir: str | Path, layer_ids: list[int] | None) -> Expectation:
    """Expected layers (len(layer_ids), or 4 for EAGLE-3), hidden size, kv_lora_rank from config.json.

    Never raises: a missing or malformed config.json (e.g. a hub id, not a path) leaves hidden_size None.
    """
    layers = len(layer_ids) if layer_ids else 4
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        return Expectation(layers=layers, hidden_size=None)
    return Expectation(
        layers=layers, hidden_size=find_hidden_size(config), kv_lora_rank=find_kv_lora_rank(config)
    )


def expectation(arg: dict[str, Any]) -> Expectation:
    """The Expectation for a check request: explicit values first, the model's config.json for the rest."""
    layers = arg.get("layers")
    hidden = arg.get("hidden_size")
    from_model = Expectation()
    if arg.get("model") is not None:  # read even when layers and hidden size are given: it names kv_lora_rank
        try:
            from_model = expectation_from_model(arg["model"], arg.get("layer_ids"))
        except Exception:  # an odd model value: check what can be checked without it
            from_model = Expectation()
        layers = layers if layers is not None else from_model.layers
        hidden = hidden if hidden is not None else from_model.hidden_size
    if layers is None and arg.get("layer_ids"):
        layers = len(arg["layer_ids"])
    return Expectation(layers=layers, hidden_size=hidden, kv_lora_rank=from_model.kv_lora_rank)


def _unreadable(file: str, fmt: str | None, message: str) -> _Result:
    return _Result(fmt, [Problem("unreadable", file, message)])


def _link_out(path: Path, root: Path) -> Problem:
    return Problem(
        "unreadable", str(path), f"a symbolic link pointing outside {root} (not followed, not read)"
    )


def _tokens(shape: tuple[int, ...]) -> int | None:
    return shape[-1] if len(shape) == 1 or (len(shape) == 2 and shape[0] == 1) else None


def _from_header(file: str, header: Header, expect: Expectation) -> _Result:
    """The shape checks of a safetensors header, with the shapes and the token count it gives."""
    tensors = header.tensors
    result = _Result(SAFETENSORS, missing_keys(file, tensors, ("token_ids", "hidden_states")))
    result.shapes = {name: list(t.shape) for name, t in tensors.items()}
    if "token_ids" in tensors:
        result.tokens = _tokens(tensors["token_ids"].shape)
    if not result.problems:
        tok, hs = tensors["token_ids"], tensors["hidden_states"]
        result.problems = check_shapes(file, tok.shape, hs.shape, hs.dtype, expect, token_dtype=tok.dtype)
    return result


def _check_safetensors(path: Path, expect: Expectation, deep: bool) -> _Result:
    file = str(path)
    try:
        header = read_header(path)
    except HeaderError as e:
        return _unreadable(file, SAFETENSORS, f"not a valid safetensors file: {e}")
    result = _from_header(file, header, expect)
    if deep and scannable(header):
        if tensorfiles.optional_module("numpy") is None:
            result.notes.append(_NO_VALUES)
            return result
        hs = header.tensors["hidden_states"]
        try:
            stats = tensorfiles.scan_safetensors(
                path, header.data_start + hs.begin, hs.end - hs.begin, hs.shape, hs.dtype
            )
        except tensorfiles.LoadError as e:
            result.problems.append(Problem("unreadable", file, str(e)))
        else:
            result.problems += value_problems(file, "hidden_states", stats)
    return result


def needs_tensor_libs(path: Path) -> bool:
    """Whether a deep check of ``path`` may import numpy or torch: anything but a regular safetensors file
    whose header leaves no values to scan (check_path then reads the header alone, stdlib only)."""
    if not path.name.endswith(".safetensors"):
        return True
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # check_path reports it without reading it
            return False
        return scannable(read_header(path))
    except (HeaderError, OSError):
        return False


def _check_zst(path: Path, expect: Expectation, deep: bool) -> _Result:
    file = str(path)
    if tensorfiles.optional_module("zstandard") is None:
        return _Result(
            SAFETENSORS, unchecked="zstandard is not importable (needed for .safetensors.zst files)"
        )
    try:
        header, stats = zstfiles.read_zst(path, deep)
    except HeaderError as e:
        return _unreadable(file, SAFETENSORS, f"not a valid zstd-compressed safetensors file: {e}")
    result = _from_header(file, header, expect)
    if stats is not None:
        result.problems += value_problems(file, "hidden_states", stats)
    elif deep and scannable(header):
        result.notes.append(_NO_VALUES)
    return result


def _value_layers(fmt: str, obj: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """The hidden-state tensors of a loaded sample, split per layer, for the value scan."""
    torch = tensorfiles.require_module("torch")
    out: list[tuple[str, list[Any]]] = []
    if fmt == SPECULATORS_PT:
        hs = obj.get("hidden_states")
        items = (
            list(hs)
            if isinstance(hs, (list, tuple)) or (isinstance(hs, torch.Tensor) and hs.dim() == 3)
            else [hs]
        )
        out.append(("hidden_states", items))
    if fmt in SPLIT_KEYS:
        last_key, aux_key = SPLIT_KEYS[fmt]
        last = obj.get(last_key)
        out.append((last_key, [last]))
        aux = obj.get(aux_key) if aux_key is not None else None
        if aux_key is not None and isinstance(aux, torch.Tensor):
            h = last.shape[-1] if isinstance(last, torch.Tensor) and last.dim() >= 1 else 0
            k = aux.shape[-1] // h if h and aux.dim() >= 1 and aux.shape[-1] % h == 0 else 1
            out.append((aux_key, list(aux.split(aux.shape[-1] // k, dim=-1)) if k > 1 else [aux]))
    float_types = (torch.float32, torch.float16, torch.bfloat16)
    return [
        (key, items)
        for key, items in out
        if items and all(isinstance(t, torch.Tensor) and t.dtype in float_types and t.numel() for t in items)
    ]


def _check_torch(path: Path, expect: Expectation, deep: bool) -> _Result:
    file = str(path)
    guess = classify(path.name, set())
    if tensorfiles.optional_module("torch") is None:
        return _Result(guess, unchecked="torch is not importable (needed for .pt/.ckpt files)")
    try:
        obj = tensorfiles.load_torch_file(path)
        sample = tensorfiles.describe(obj)
    except tensorfiles.LoadError as e:
        return _unreadable(file, guess, str(e))
    fmt = classify(path.name, set(sample))
    result = _Result(fmt, check_sample(file, fmt, sample, expect))
    ids = sample.get("input_ids")
    if isinstance(ids, TensorMeta):
        result.tokens = _tokens(ids.shape)
    if deep:
        try:
            for key, layers in _value_layers(fmt, obj):
                result.problems += value_problems(file, key, tensorfiles.torch_layer_stats(layers))
        except Exception as e:  # e.g. sparse tensors: torch cannot scan them like dense ones
            result.notes.append(f"{file}: value scan skipped: {type(e).__name__}: {str(e)[:120]}")
    return result


def _sniff(path: Path, expect: Expectation, deep: bool) -> _Result:
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith((tensorfiles.GZIP_MAGIC, *tensorfiles.TORCH_MAGIC)):
        return _check_torch(path, expect, deep)
    if head.startswith(zstfiles.ZSTD_MAGIC):
        return _check_zst(path, expect, deep)
    try:
        read_header(path)
    except HeaderError as e:
        return _unreadable(
            str(path),
            None,
            f"unknown format: it starts with {head!r}, neither a torch file (zip, pickle, gzip), zstd, "
            f"nor safetensors ({e})",
        )
    return _check_safetensors(path, expect, deep)


def _check_file(path: Path, expect: Expectation, deep: bool, locked: bool, root: Path) -> _Result:
    name = path.name
    fmt = SAFETENSORS if name.endswith((".safetensors", ".safetensors.zst")) else None
    if locked:
        return _Result(fmt, unchecked="still being written (a .lock file is beside it)")
    # A link out of the output dir (say to /etc/shadow) must not put that file's bytes into a message.
    if escapes(path, root):
        return _Result(fmt, [_link_out(path, root)])
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):  # a FIFO or device named like a capture file would block or mislead
            return _unreadable(str(path), fmt, "not a regular file")
        if name.endswith(".safetensors"):
            return _check_safetensors(path, expect, deep)
        if name.endswith(".safetensors.zst"):
            return _check_zst(path, expect, deep)
        if CAPTURE.match(name):
            return _check_torch(path, expect, deep)
        return _sniff(path, expect, deep)
    except FileNotFoundError:
        return _Result(fmt, unchecked="vanished while being checked (moved or deleted)")
    except OSError as e:
        return _unreadable(str(path), fmt, f"cannot read the file: {e.strerror or e}")


def check_path(path: str | Path, expect: Expectation = Expectation(), deep: bool = True) -> CheckReport:  # noqa: B008
    """Check one capture file or every capture file under a directory; see the module docstring for `ok`."""
    p = Path(path)
    if is_capture_file(p.name) and escapes(p, p.parent):  # a capture file linked (even to a dir) elsewhere
        return CheckReport(False, 0, None, [_link_out(p, p.parent)], [], [])
    try:
        is_dir = stat.S_ISDIR(os.stat(p).st_mode)
    except OSError as e:
        return CheckReport(False, 0, None, [], [str(p)], [f"{p}: {(e.strerror or 'cannot be read').lower()}"])
    lengths, lengths_note = read_sample_lengths(p if is_dir else p.parent)
    notes: list[str] = [lengths_note] if lengths_note else []
    if is_dir:
        entries = walk(p)
        gaps = directory_gaps(p, entries, lengths.keys())
    else:
        entries = [(p, any((p.parent / lk).exists() for lk in lock_names(p.name)))]
        gaps = []
    problems: list[Problem] = []
    unchecked: list[str] = []
    reasons: Counter[str] = Counter()
    formats: set[str] = set()
    checked = 0
    shapes: dict[str, list[int]] = {}
    for file, locked in entries:
        try:
            r = _check_file(file, expect, deep, locked, p if is_dir else p.parent)
        except Exception as e:  # a hostile file must not take the checker (or the daemon's sweep) down
            r = _Result(None, unchecked=f"checker error: {type(e).__name__}: {str(e)[:200]}")
        if r.format:
            formats.add(r.format)
        if r.unchecked is not None:
            unchecked.append(str(file))
            reasons[r.unchecked] += 1
            continue
        checked += 1
        shapes = r.shapes or shapes
        problems += r.problems
        if lengths:
            problems += length_problem(str(file), r.tokens, lengths)
        notes += [n for n in r.notes if n not in notes]
    problems += gaps
    notes += [f"{n} file{'s' if n > 1 else ''} unchecked: {why}" for why, n in reasons.items()]
    if not entries:
        notes.append(f"{p}: no capture files found")
    fmt = formats.pop() if len(formats) == 1 else ("mixed" if formats else None)
    return CheckReport(not problems and checked > 0, checked, fmt, problems, unchecked, notes, shapes)
