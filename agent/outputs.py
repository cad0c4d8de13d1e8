"""Check captured hidden-state files (or a directory of them) and report problems with stable codes.

How it works: a file's format comes from its name (hs_N / *.safetensors, data_N.pt, data_N.ckpt[.gz]) or,
for other names, its first bytes. safetensors files are checked from the header alone (stdlib); torch files
are loaded with torch when it is importable, else listed as unchecked. With deep=True, hidden states are
scanned for NaN/Inf and all-zero layers (numpy, else torch; skipped with a note when neither is there).
The rules themselves are pure (agent.output_shapes, agent.output_formats); this module does the I/O.

Report semantics: ``ok`` is True only when at least one file was checked and no problem was found — a run
where everything was unchecked (or nothing was found) is never ``ok``. Files still being written (a
``.lock`` beside them) are unchecked, not problems. check_path never raises for file-system conditions.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import tensorfiles
from agent.output_formats import EAGLE, SAFETENSORS, SPECFORGE, SPECULATORS_PT, check_sample, classify
from agent.output_shapes import (
    Expectation,
    Problem,
    TensorMeta,
    check_shapes,
    missing_keys,
    value_problems,
)
from agent.safetensors_header import HeaderError, read_header

__all__ = [
    "CheckReport",
    "Expectation",
    "Problem",
    "TensorMeta",
    "check_path",
    "check_shapes",
    "expectation_from_model",
    "is_capture_file",
]

_CAPTURE = re.compile(
    r"^(?:(?P<hs>hs)_(?P<hs_i>\d+)\.safetensors|(?P<data>data)_(?P<data_i>\d+)\.(?P<ext>pt|ckpt|ckpt\.gz)"
    r"|[^/]+\.safetensors)$"
)
_NO_TORCH = "torch is not importable (needed for .pt/.ckpt files)"
_NO_VALUES = "value checks (NaN/Inf, all-zero) skipped: neither numpy nor torch is importable"


@dataclass(frozen=True)
class CheckReport:
    """The result of checking a file or directory: the shape of `eaglewatch-agent check --json`."""

    ok: bool
    files: int
    format: str | None
    problems: list[Problem]
    unchecked: list[str]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form: ok, files, format, problems [{code, file, message}], unchecked, notes."""
        return {
            "ok": self.ok,
            "files": self.files,
            "format": self.format,
            "problems": [p.to_dict() for p in self.problems],
            "unchecked": list(self.unchecked),
            "notes": list(self.notes),
        }


@dataclass
class _Result:
    format: str | None
    problems: list[Problem] = field(default_factory=list)
    unchecked: str | None = None  # the reason, when the file could not be checked
    notes: list[str] = field(default_factory=list)


def is_capture_file(name: str) -> bool:
    """True for file names a capture run writes: hs_N/*.safetensors, data_N.pt, data_N.ckpt[.gz]."""
    base = os.path.basename(name)
    return not base.startswith(".") and _CAPTURE.match(base) is not None


def _family(name: str) -> tuple[str, int] | None:
    m = _CAPTURE.match(name)
    if m is None:
        return None
    if m["hs"]:
        return "hs_{}.safetensors", int(m["hs_i"])
    if m["data"]:
        return "data_{}." + ("pt" if m["ext"] == "pt" else "ckpt"), int(m["data_i"])
    return None


def find_hidden_size(config: dict[str, Any]) -> int | None:
    """The language model's hidden size from a config.json dict (text/language config of VL shells first)."""
    nested = [config.get(k) for k in ("text_config", "language_config", "llm_config")]
    thinker = config.get("thinker_config")
    if isinstance(thinker, dict):
        nested.append(thinker.get("text_config"))
    for cfg in [*nested, config]:
        if not isinstance(cfg, dict):
            continue
        for key in ("hidden_size", "d_model", "n_embd", "dim"):
            v = cfg.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def expectation_from_model(model_dir: str | Path, layer_ids: list[int] | None) -> Expectation:
    """Expected layers (len(layer_ids), or 4 for EAGLE-3) and hidden size from model_dir/config.json.

    Never raises: a missing or malformed config.json (e.g. a hub id, not a path) leaves hidden_size None.
    """
    layers = len(layer_ids) if layer_ids else 4
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return Expectation(layers=layers, hidden_size=None)
    return Expectation(
        layers=layers, hidden_size=find_hidden_size(config) if isinstance(config, dict) else None
    )


def _unreadable(file: str, fmt: str | None, message: str) -> _Result:
    return _Result(fmt, [Problem("unreadable", file, message)])


def _check_safetensors(path: Path, expect: Expectation, deep: bool) -> _Result:
    file = str(path)
    try:
        header = read_header(path)
    except HeaderError as e:
        return _unreadable(file, SAFETENSORS, f"not a valid safetensors file: {e}")
    tensors = header.tensors
    problems = missing_keys(file, tensors, ("token_ids", "hidden_states"))
    if problems:
        return _Result(SAFETENSORS, problems)
    tok, hs = tensors["token_ids"], tensors["hidden_states"]
    problems = check_shapes(file, tok.shape, hs.shape, hs.dtype, expect, token_dtype=tok.dtype)
    result = _Result(SAFETENSORS, problems)
    if deep and hs.dtype in ("BF16", "F16", "F32") and math.prod(hs.shape) > 0:
        if tensorfiles.value_backend() is None:
            result.notes.append(_NO_VALUES)
            return result
        try:
            stats = tensorfiles.scan_safetensors(
                path, header.data_start + hs.begin, hs.end - hs.begin, hs.shape, hs.dtype
            )
        except tensorfiles.LoadError as e:
            result.problems.append(Problem("unreadable", file, str(e)))
        else:
            result.problems += value_problems(file, "hidden_states", stats)
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
    if fmt in (SPECFORGE, EAGLE):
        out.append(("hidden_state", [obj.get("hidden_state")]))
    aux, last = obj.get("aux_hidden_state"), obj.get("hidden_state")
    if fmt == SPECFORGE and isinstance(aux, torch.Tensor):
        h = last.shape[-1] if isinstance(last, torch.Tensor) and last.dim() >= 1 else 0
        k = aux.shape[-1] // h if h and aux.dim() >= 1 and aux.shape[-1] % h == 0 else 1
        out.append(("aux_hidden_state", list(aux.split(aux.shape[-1] // k, dim=-1)) if k > 1 else [aux]))
    float_types = (torch.float32, torch.float16, torch.bfloat16)
    return [
        (key, items)
        for key, items in out
        if items and all(isinstance(t, torch.Tensor) and t.dtype in float_types and t.numel() for t in items)
    ]


def _check_torch(path: Path, expect: Expectation, deep: bool) -> _Result:
    file = str(path)
    guess = SPECULATORS_PT if path.name.endswith(".pt") else SPECFORGE
    if tensorfiles.optional_module("torch") is None:
        return _Result(guess, unchecked=_NO_TORCH)
    try:
        obj = tensorfiles.load_torch_file(path)
        sample = tensorfiles.describe(obj)
    except tensorfiles.LoadError as e:
        return _unreadable(file, guess, str(e))
    fmt = classify(path.name, set(sample))
    result = _Result(fmt, check_sample(file, fmt, sample, expect))
    if deep:
        for key, layers in _value_layers(fmt, obj):
            result.problems += value_problems(file, key, tensorfiles.torch_layer_stats(layers))
    return result


def _sniff(path: Path, expect: Expectation, deep: bool) -> _Result:
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith((tensorfiles.GZIP_MAGIC, *tensorfiles.TORCH_MAGIC)):
        return _check_torch(path, expect, deep)
    try:
        read_header(path)
    except HeaderError as e:
        return _unreadable(
            str(path),
            None,
            f"unknown format: it starts with {head!r}, neither a torch file (zip, pickle, gzip) "
            f"nor safetensors ({e})",
        )
    return _check_safetensors(path, expect, deep)


def _check_file(path: Path, expect: Expectation, deep: bool, locked: bool) -> _Result:
    name = path.name
    fmt = SAFETENSORS if name.endswith(".safetensors") else None
    if locked:
        return _Result(fmt, unchecked="still being written (a .lock file is beside it)")
    try:
        if name.endswith(".safetensors"):
            return _check_safetensors(path, expect, deep)
        if _CAPTURE.match(name):
            return _check_torch(path, expect, deep)
        return _sniff(path, expect, deep)
    except FileNotFoundError:
        return _Result(fmt, unchecked="vanished while being checked (moved or deleted)")
    except OSError as e:
        return _unreadable(str(path), fmt, f"cannot read the file: {e.strerror or e}")


def _lock_names(name: str) -> tuple[str, str]:
    return name + ".lock", name.split(".", 1)[0] + ".lock"


def _walk(root: Path) -> list[tuple[Path, bool]]:
    found: list[tuple[Path, bool]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        names = set(filenames)
        for name in sorted(filenames, key=_natural):
            if is_capture_file(name):
                found.append((Path(dirpath) / name, any(lk in names for lk in _lock_names(name))))
    return found


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _ranges(missing: list[int], family: str) -> str:
    spans: list[tuple[int, int]] = []
    for i in missing:
        if spans and spans[-1][1] == i - 1:
            spans[-1] = (spans[-1][0], i)
        else:
            spans.append((i, i))
    prefix = family.split("{}")[0]
    words = [f"{prefix}{a}" if a == b else f"{prefix}{a}–{prefix}{b}" for a, b in spans[:10]]
    return ", ".join(words) + (f", … ({len(spans) - 10} more ranges)" if len(spans) > 10 else "")


def index_gaps(root: str, names: list[str]) -> list[Problem]:
    """index_gap problems for holes between the lowest and highest hs_N / data_N index (pure)."""
    families: dict[str, set[int]] = {}
    for name in names:
        fam = _family(os.path.basename(name))
        if fam is not None:
            families.setdefault(fam[0], set()).add(fam[1])
    problems = []
    for family, ids in sorted(families.items()):
        lo, hi = min(ids), max(ids)
        missing = [i for i in range(lo, hi + 1) if i not in ids]
        if missing:
            span = f"{family.format(lo)} … {family.format(hi)}"
            problems.append(
                Problem(
                    "index_gap",
                    root,
                    f"index gap: {len(missing)} file{'s' if len(missing) > 1 else ''} missing in {span}: "
                    + _ranges(missing, family),
                )
            )
    return problems


def check_path(path: str | Path, expect: Expectation = Expectation(), deep: bool = True) -> CheckReport:  # noqa: B008
    """Check one capture file or every capture file under a directory; see the module docstring for `ok`."""
    p = Path(path)
    if p.is_dir():
        entries = _walk(p)
        gaps = index_gaps(str(p), [str(f) for f, _ in entries])
    elif p.exists():
        entries = [(p, any((p.parent / lk).exists() for lk in _lock_names(p.name)))]
        gaps = []
    else:
        return CheckReport(False, 0, None, [], [str(p)], [f"{p}: no such file or directory"])
    problems: list[Problem] = []
    unchecked: list[str] = []
    reasons: Counter[str] = Counter()
    notes: list[str] = []
    formats: set[str] = set()
    checked = 0
    for file, locked in entries:
        r = _check_file(file, expect, deep, locked)
        if r.format:
            formats.add(r.format)
        if r.unchecked is not None:
            unchecked.append(str(file))
            reasons[r.unchecked] += 1
            continue
        checked += 1
        problems += r.problems
        notes += [n for n in r.notes if n not in notes]
    problems += gaps
    notes += [f"{n} file{'s' if n > 1 else ''} unchecked: {why}" for why, n in reasons.items()]
    if not entries:
        notes.append(f"{p}: no capture files found")
    fmt = formats.pop() if len(formats) == 1 else ("mixed" if formats else None)
    return CheckReport(not problems and checked > 0, checked, fmt, problems, unchecked, notes)
