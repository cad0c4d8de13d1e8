"""Pure shape and value rules for capture files: shapes and dtypes in, Problems out (no I/O, stdlib only).

``Expectation.layers`` counts every captured layer, the final one included (EAGLE-3 default 4 = three
auxiliary layers + the last).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})
INT_DTYPES = frozenset({"I64", "I32", "U32", "I16", "U16", "U64", "I8", "U8"})

#: torch's dtype names (str(dtype) without "torch.") in safetensors' spelling
_DTYPE_ALIASES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


@dataclass(frozen=True)
class Expectation:
    """What a run should capture: number of layers per token and the model's hidden size (None = unknown).

    kv_lora_rank: the MLA latent width of DeepSeek-V2-family models (512 for DeepSeek-V3/Kimi), to name a
    capture of the attention latent instead of the residual stream.
    """

    layers: int | None = None
    hidden_size: int | None = None
    kv_lora_rank: int | None = None


MLA_LATENT_HINT = "looks like the MLA latent, not the residual stream"


def width_mismatch(where: str, got: int, expect: Expectation) -> str:
    """The hidden_size_mismatch message; names the MLA latent when the width is the model's kv_lora_rank."""
    msg = f"hidden size mismatch: {where} has {got}, expected {expect.hidden_size}"
    if expect.kv_lora_rank is not None and got == expect.kv_lora_rank:
        msg += f" ({got} is the model's kv_lora_rank: {MLA_LATENT_HINT})"
    return msg


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a capture file (or a directory, for index_gap), in words a UI can show."""

    code: str
    file: str
    message: str

    def to_dict(self) -> dict[str, str]:
        """The JSON shape used by `eaglewatch-agent check --json` and the journal."""
        return {"code": self.code, "file": self.file, "message": self.message}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and canonical dtype of one tensor, as read from a header or a loaded object."""

    shape: tuple[int, ...]
    dtype: str


# What a loaded .pt/.ckpt value looks like once described: a tensor, a list of tensors, or something else
# (kept as its type name for the message).
Described = TensorMeta | list[TensorMeta] | str


@dataclass(frozen=True)
class ValueStats:
    """Result of a value scan of one hidden-state tensor, per layer."""

    layer_nonzero: tuple[bool, ...]
    non_finite: int = 0
    first_bad: tuple[int, int] | None = None  # (token, layer) of the first NaN/Inf


def canonical_dtype(dtype: str) -> str:
    """Map torch/numpy/safetensors dtype spellings ('torch.bfloat16', 'bfloat16', 'BF16') to 'BF16' style."""
    name = dtype.strip()
    name = name.removeprefix("torch.")
    return _DTYPE_ALIASES.get(name.lower(), name.upper())


def dims(shape: tuple[int, ...] | list[Any]) -> str:
    """Render a shape the way the messages do: [512, 4, 7168]."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _n(v: int | None, placeholder: str) -> str:
    return placeholder if v is None else str(v)


def _layer_hint(got: int, want: int) -> str:
    if got == want - 1:
        return " (final layer dropped?)"
    if got > want:
        return " (extra layer captured?)"
    return ""


def float_check(file: str, key: str, dtype: str) -> list[Problem]:
    """dtype_unexpected unless key's dtype is one a model computes in (BF16, F16, F32)."""
    d = canonical_dtype(dtype)
    if d in FLOAT_DTYPES:
        return []
    return [Problem("dtype_unexpected", file, f"{key} is {d}, expected a float dtype (BF16, F16 or F32)")]


def token_count(
    file: str, key: str, shape: tuple[int, ...], dtype: str | None
) -> tuple[int | None, list[Problem]]:
    """The number of tokens T of a [T] (or [1, T]) id tensor, with problems when it is not one."""
    problems: list[Problem] = []
    d = canonical_dtype(dtype) if dtype is not None else None
    if d is not None and d not in INT_DTYPES:
        problems.append(Problem("dtype_unexpected", file, f"{key} is {d}, expected an integer dtype"))
    if len(shape) == 2 and shape[0] == 1:
        shape = shape[1:]  # a batch axis of 1 is harmless
    if len(shape) != 1:
        problems.append(
            Problem("seq_len_mismatch", file, f"{key} has shape {dims(shape)}, expected a flat [T]")
        )
        return None, problems
    if shape[0] == 0:
        problems.append(Problem("seq_len_mismatch", file, f"empty sample: {key} has 0 tokens"))
    return shape[0], problems


def squeeze_batch(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Drop a leading batch axis of 1 from a 3-axis shape ([1, T, H] -> [T, H])."""
    return shape[1:] if len(shape) == 3 and shape[0] == 1 else shape


def check_shapes(
    file: str,
    token_ids: tuple[int, ...],
    hidden_states: tuple[int, ...],
    dtype: str,
    expect: Expectation,
    token_dtype: str | None = None,
) -> list[Problem]:
    """Check a vLLM/speculators sample: token_ids [T], hidden_states [T, layers, hidden] of a float dtype."""
    t, problems = token_count(file, "token_ids", tuple(token_ids), token_dtype)
    problems += float_check(file, "hidden_states", dtype)
    hs = tuple(hidden_states)
    want_l, want_h = expect.layers, expect.hidden_size
    wanted = f"[{_n(t, 'T')}, {_n(want_l, 'layers')}, {_n(want_h, 'hidden')}]"
    if len(hs) == 3:
        ht, hl, hh = hs
        if t is not None and ht != t:
            problems.append(
                Problem("seq_len_mismatch", file, f"hidden_states has {ht} tokens but token_ids has {t}")
            )
        if want_l is not None and hl != want_l:
            problems.append(
                Problem(
                    "layer_count_mismatch",
                    file,
                    f"layer count mismatch: hidden_states has {hl} layers, expected {want_l}"
                    + _layer_hint(hl, want_l),
                )
            )
        if want_h is not None and hh != want_h:
            problems.append(
                Problem("hidden_size_mismatch", file, width_mismatch("hidden_states", hh, expect))
            )
        return problems
    last = hs[-1] if hs else None
    if len(hs) == 2 and want_h is not None and last == want_h:
        msg = f"hidden_states is {dims(hs)}: no layer axis, expected {wanted}"
        problems.append(Problem("layer_count_mismatch", file, msg))
    elif len(hs) == 2 and want_h and want_l and last == want_h * want_l:
        msg = f"hidden_states is {dims(hs)}: layers flattened into the last axis, expected {wanted}"
        problems.append(Problem("layer_count_mismatch", file, msg))
    elif len(hs) < 2 or (len(hs) == 2 and (last == t or want_h is not None)):
        problems.append(
            Problem(
                "hidden_dim_lost",
                file,
                f"hidden dimension lost: hidden_states is {dims(hs)}, expected {wanted}",
            )
        )
    elif len(hs) == 2:
        msg = f"hidden_states is {dims(hs)}: no layer axis, expected {wanted}"
        problems.append(Problem("layer_count_mismatch", file, msg))
    else:
        msg = f"hidden_states has {len(hs)} axes {dims(hs)}, expected 3: {wanted}"
        problems.append(Problem("layer_count_mismatch", file, msg))
    return problems


def missing_keys(file: str, found: dict[str, Any], required: tuple[str, ...]) -> list[Problem]:
    """One missing_key problem per required key absent from found (the message lists what is there)."""
    have = ", ".join(sorted(found)) or "nothing"
    return [
        Problem("missing_key", file, f"missing key {key!r} (found: {have})")
        for key in required
        if key not in found
    ]


def _describe_items(items: list[TensorMeta]) -> str:
    counts = Counter(m.shape for m in items)
    if len(counts) == 1:
        return f"{len(items)} items of {dims(items[0].shape)}"
    parts = ", ".join(f"{n} × {dims(s)}" for s, n in counts.most_common(3))
    return f"{len(items)} items ({parts}{', …' if len(counts) > 3 else ''})"


def check_layer_list(
    file: str, key: str, items: list[TensorMeta], t: int | None, expect: Expectation
) -> list[Problem]:
    """Check a list of per-layer tensors, each [T, hidden] (old speculators `hidden_states`)."""
    want_l, want_h = expect.layers, expect.hidden_size
    wanted = f"{_n(want_l, 'n_layers')} × [{_n(t, 'T')}, {_n(want_h, 'hidden')}]"
    shapes = [squeeze_batch(m.shape) for m in items]
    if not items or any(len(s) < 2 for s in shapes):
        got = _describe_items(items) if items else "an empty list"
        return [Problem("hidden_dim_lost", file, f"hidden dimension lost: {got}, expected {wanted}")]
    problems: list[Problem] = []
    if want_l is not None and len(items) != want_l:
        problems.append(
            Problem(
                "layer_count_mismatch",
                file,
                f"layer count mismatch: {key} has {len(items)} layers, expected {want_l}"
                + _layer_hint(len(items), want_l),
            )
        )
    for dtype in sorted({m.dtype for m in items}):
        problems += float_check(file, key, dtype)
    for shape in sorted(set(shapes)):
        layers = [i for i, s in enumerate(shapes) if s == shape]
        if len(layers) == len(shapes):
            where = f"every {key} layer" if len(layers) > 1 else f"{key} layer 0"
        else:
            where = f"{key} layer {layers[0]}" if len(layers) == 1 else f"{key} layers {_ids(layers)} each"
        if len(shape) != 2:
            problems.append(
                Problem("layer_count_mismatch", file, f"{where} is {dims(shape)}, expected [T, hidden]")
            )
            continue
        if t is not None and shape[0] != t:
            problems.append(
                Problem("seq_len_mismatch", file, f"{where} has {shape[0]} tokens but input_ids has {t}")
            )
        if want_h is not None and shape[1] != want_h:
            problems.append(Problem("hidden_size_mismatch", file, width_mismatch(where, shape[1], expect)))
    return problems


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:8])) + (", …" if len(ids) > 8 else "")


def check_mask(file: str, meta: TensorMeta, t: int | None) -> list[Problem]:
    """A loss_mask must have one entry per token (a batch axis of 1 is harmless)."""
    shape = meta.shape[1:] if len(meta.shape) == 2 and meta.shape[0] == 1 else meta.shape
    if t is None or shape == (t,):
        return []
    return [
        Problem("seq_len_mismatch", file, f"loss_mask is {dims(meta.shape)} but input_ids has {t} tokens")
    ]


def value_problems(file: str, key: str, stats: ValueStats) -> list[Problem]:
    """Turn a value scan into non_finite / all_zero problems (one all-zero layer spoils training)."""
    problems: list[Problem] = []
    if stats.non_finite:
        where = ""
        if stats.first_bad is not None:
            token, layer = stats.first_bad
            where = f" (first at token {token}" + (
                f", layer {layer})" if len(stats.layer_nonzero) > 1 else ")"
            )
        plural = "s" if stats.non_finite != 1 else ""
        message = f"{key} has {stats.non_finite} NaN/Inf value{plural}{where}"
        problems.append(Problem("non_finite", file, message))
    n = len(stats.layer_nonzero)
    zero = [i for i, nz in enumerate(stats.layer_nonzero) if not nz]
    if zero and len(zero) == n:
        problems.append(
            Problem("all_zero", file, f"{key} is all zero" + (f" (all {n} layers)" if n > 1 else ""))
        )
    elif zero:
        which = f"layer {zero[0]} is" if len(zero) == 1 else f"layers {_ids(zero)} are"
        problems.append(Problem("all_zero", file, f"{key} {which} all zero (of {n} layers)"))
    return problems
