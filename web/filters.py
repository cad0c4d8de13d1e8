"""Jinja filters and helpers: times, sizes, milestone fields and problem codes in words, secret masking."""

from __future__ import annotations

import re
import time
from typing import Any

import jinja2

from agent.backends import DEFAULT, SUMMARY, Backend
from agent.milestones.records import json_record_lines

PROBLEM_WORDS = {
    "unreadable": "file cannot be read (truncated, corrupt or unknown format)",
    "missing_key": "a required tensor is missing",
    "hidden_dim_lost": "hidden dimension lost",
    "layer_count_mismatch": "wrong number of captured layers",
    "hidden_size_mismatch": "hidden size differs from the model's",
    "seq_len_mismatch": "hidden states and token ids differ in length",
    "dtype_unexpected": "unexpected data type",
    "non_finite": "NaN or Inf values",
    "all_zero": "hidden states are all zero",
    "index_gap": "missing file indices (gap)",
}
FIELD_LABELS = {
    "gib": "GiB", "memory_gib": "GiB", "weights_gib": "GiB loaded", "kv_tokens": "KV tokens",
    "tokens": "tokens", "ranks": "ranks", "seconds": "s", "samples_done": "samples", "samples_total": "of",
    "tokens_per_s": "tok/s", "samples_per_s": "samples/s", "files_written": "files", "bytes_written": "bytes",
    "root_cause": "root cause",
}  # fmt: skip
#: Bookkeeping fields of the rule engine, not worth a reader's attention.
_HIDDEN_FIELDS = frozenset({"rule", "processes"})
SECRET_MASK = "•••••• (hidden)"
#: Parts of an environment name that mark its value secret; PASS covers PASSWORD, PASSWD and PASSPHRASE, and
#: hiding a harmless value by mistake costs less than showing a secret.
_SECRET_RE = re.compile(r"PASS|PEM|KEY|TOKEN|SECRET|CREDENTIAL|AUTH|COOKIE|SESSION", re.I)


def clock(ts: float | None) -> str:
    """UTC wall-clock time of a timestamp."""
    if not ts:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + " UTC"


def since(ts: float | None, t0: float | None) -> str:
    """Time after launch, e.g. ``+1m 05.2s``."""
    if ts is None or t0 is None:
        return ""
    d = max(0.0, ts - t0)
    if d < 60:
        return f"+{d:.1f}s"
    m, s = divmod(d, 60)
    if m < 60:
        return f"+{int(m)}m {s:04.1f}s"
    h, m = divmod(m, 60)
    return f"+{int(h)}h {int(m):02d}m"


def num(value: Any) -> str:
    """Numbers readable at a glance (1,234,567 / 12.3)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.1f}"


def field_items(fields: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs of a milestone's fields, known ones first."""
    out = []
    fields = {k: v for k, v in fields.items() if k not in _HIDDEN_FIELDS}
    for key, value in sorted(fields.items(), key=lambda kv: (kv[0] not in FIELD_LABELS, kv[0])):
        if isinstance(value, list):
            text = ", ".join(str(v) for v in value[:16]) + (" …" if len(value) > 16 else "")
        elif isinstance(value, dict):
            text = ", ".join(f"{k}={v}" for k, v in list(value.items())[:8])
        else:
            text = num(value)
        out.append((FIELD_LABELS.get(key, key.replace("_", " ")), text))
    return out


def gib(mib: Any) -> str:
    """MiB → GiB text."""
    return f"{mib / 1024:.1f}" if isinstance(mib, (int, float)) else "?"


def size(nbytes: Any) -> str:
    """Bytes in binary units (1.5 GiB), exact below 1 KiB."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)):
        return "?"
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{int(nbytes):,} B" if unit == "B" else f"{value:.1f} {unit}"


def duration(seconds: Any) -> str:
    """A duration at a glance: 42s, 7m 05s, 3h 20m."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def problem_words(code: str) -> str:
    """A problem code explained."""
    return PROBLEM_WORDS.get(code, code.replace("_", " "))


def is_secret_name(name: str) -> bool:
    """True for environment names whose values are never shown or saved (``*PASS*``, ``*KEY*``…): the API's
    run view, the run page and the run-again form all ask this."""
    return bool(_SECRET_RE.search(name))


def masked_env(env: dict[str, str] | None) -> list[tuple[str, str]]:
    """Environment for display: values of secret-looking names are never rendered."""
    return [(k, SECRET_MASK if is_secret_name(k) else v) for k, v in sorted((env or {}).items())]


def masked_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec for the API: values of secret-looking environment names replaced, the rest as stored."""
    env = spec.get("env")
    if not isinstance(env, dict):
        return spec
    return {**spec, "env": {k: SECRET_MASK if is_secret_name(k) else v for k, v in env.items()}}


def percent(progress: dict[str, Any] | None) -> float | None:
    """Samples done as a percentage, when the total is known."""
    if not progress:
        return None
    done, total = progress.get("samples_done"), progress.get("samples_total")
    if isinstance(done, (int, float)) and isinstance(total, (int, float)) and total > 0:
        return min(100.0, 100.0 * done / total)
    return None


def spec_value(value: Any) -> str:
    """A spec value as text: lists space-separated (argv), dicts as key=value pairs."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items() if v is not None) or "—"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def log_text(text: str) -> str:
    """A log line as text: vLLM's JSON records as the text line they stand for (an exception's lines joined
    with ⏎, since the log view shows one row per line); anything else unchanged. Same as logText in app.js."""
    lines = json_record_lines(text) if text[:1] == "{" else None
    return " ⏎ ".join(lines) if lines else text


def install(env: jinja2.Environment) -> None:
    """Register the filters and globals on an environment."""
    for f in (clock, since, num, gib, size, duration, problem_words, log_text):
        env.filters[f.__name__] = f
    for g in (spec_value, field_items, masked_env, percent):
        env.globals[g.__name__] = g
    env.globals["backend_choices"] = [(b.value, f"{b.value} ({SUMMARY[b]})") for b in Backend]
    env.globals["default_backend"] = DEFAULT.value
