"""Milestone rule data: the TOML schema, validation with typed errors, field conversions, loading.

The schema is docs/milestones.md's ("Rules are data"); what it leaves implicit: ``words`` matches whole
whitespace-delimited words (cheaper than ``contains``; with neither prefilter a rule runs on every line),
``once`` emits only a rule's first match in a log (tqdm redraws), and a ``marker`` rule's regex group
``json`` holds an object whose ``kind`` (else the rule's) and other keys become the milestone.  Rules are
tried in order (built-ins, ``--rules`` files, the run spec's) and the first whose regex matches wins; a
later rule of the same name replaces an earlier one, ``enabled = false`` switches it off.
"""

from __future__ import annotations

import ast
import json
import math
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.backends import OWN, PIPELINES, Backend
from agent.milestones.regex_safety import check_user_regex

_NUM_RE = re.compile(r"[-+]?(?:\d[\d,_ ]*)?\.?\d+(?:[eE][-+]?\d+)?")
_UNIT_TO_GIB = {
    "": 1.0, "gib": 1.0, "g": 1.0, "gb": 1e9 / 2**30, "mib": 1 / 1024, "mb": 1e6 / 2**30,
    "kib": 1 / 2**20, "kb": 1e3 / 2**30, "tib": 1024.0, "tb": 1e12 / 2**30, "b": 1 / 2**30,
}  # fmt: skip


def _number(raw: str) -> tuple[str, int]:
    """The first number in ``raw`` without its separators, and where it ends."""
    m = _NUM_RE.search(raw)
    if not m:
        raise ValueError(f"no number in {raw!r}")
    return m.group().replace(",", "").replace("_", "").replace(" ", ""), m.end()


def _to_int(raw: str) -> int:
    try:
        return int(raw)  # the common case, without the regex
    except ValueError:
        pass
    num, _ = _number(raw)
    return int(num) if re.fullmatch(r"[-+]?\d+", num) else int(float(num))


def _to_float(raw: str) -> float:
    try:
        value = float(raw)  # the common case, without the regex
    except ValueError:
        value = float(_number(raw)[0])
    if not math.isfinite(value):  # nan/inf would not be valid JSON
        raise ValueError(f"not a finite number: {raw!r}")
    return value


def _to_gib(raw: str) -> float:
    num, end = _number(raw)
    unit = re.match(r"\s*([A-Za-z]*)", raw[end:])
    value = float(num) * _UNIT_TO_GIB.get(unit.group(1).lower() if unit else "", 1.0)
    if not math.isfinite(value):  # "1e999 GiB" would be inf, which is not JSON
        raise ValueError(f"not a finite size: {raw!r}")
    return value


def _to_list(raw: str) -> list[Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        value = ast.literal_eval(raw)  # vLLM prints Python reprs: ['a', 'b']
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"not a list: {raw[:80]!r}")
    json.dumps(value)  # only JSON-representable items (bytes, sets... raise TypeError)
    return list(value)


def _to_clock(raw: str) -> int:
    """tqdm's "[H:]MM:SS" → seconds."""
    parts = raw.strip().split(":")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a clock time: {raw[:40]!r}")
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return seconds


CONVERTERS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "clock": _to_clock,
    "int": _to_int,
    "float": _to_float,
    "gib": _to_gib,
    "percent": _to_float,
    "seconds": _to_float,
    "list": _to_list,
}


#: What a converter may raise on a value it cannot read (the value then stays a string).
CONVERT_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, OverflowError)


def convert(kind: str, raw: str) -> Any:
    """Convert a captured group; on failure keep the raw string (a log line never breaks ingestion)."""
    try:
        return CONVERTERS[kind](raw)
    except CONVERT_ERRORS:
        return raw


KINDS = frozenset(
    {
        "launched", "engine_config", "extension_injected", "weights_loaded", "kv_cache_ready",
        "cuda_graphs_captured", "engine_ready", "server_ready", "capture_configured", "batch_captured",
        "shape_check_passed", "shape_check_failed", "progress", "throughput", "warning", "error",
        "completed", "failed", "forecast", "canary_checked", "normal_shutdown",
    }
)  # fmt: skip
ERROR_CLASSES = frozenset(
    {
        "oom", "nccl", "import", "api_mismatch", "rpc_timeout", "worker_died", "engine_failed", "shm_stall",
        "kv_cache", "killed", "segfault", "config_incompatible", "traceback",
    }
)  # fmt: skip
SEVERITIES = ("info", "warning", "error", "critical")
BUILTIN_DIR = Path(__file__).with_name("rules")
#: Rule files for lines only the users' own pipelines print, one named after each: a run of eaglewatch's own
#: vLLM backends never reads them (they would double its tail+rules cost).
PIPELINE_FILES = tuple(f"{backend}.toml" for backend in PIPELINES)
BUILTIN_FILES = ("vllm.toml", "errors.toml", "eaglewatch.toml", *PIPELINE_FILES)


class RuleError(ValueError):
    """A rule that cannot be used; names the source, the rule's index (0-based) and name, and the field."""

    def __init__(
        self, source: str, index: int | None, field_name: str | None, message: str, name: str | None = None
    ) -> None:
        where = source
        if index is not None:
            where += f": rule[{index}]" + (f" {name!r}" if name else "")
        if field_name:
            where += f": field '{field_name}'"
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Rule:
    """One validated milestone rule (see the module docstring for the schema)."""

    name: str
    kind: str
    regex: re.Pattern[str]
    contains: tuple[str, ...] = ()
    words: tuple[str, ...] = ()
    fields: Mapping[str, str] = field(default_factory=dict)
    set: Mapping[str, Any] = field(default_factory=dict)
    per_rank: bool = False
    error_class: str | None = None
    severity: str = "info"
    once: bool = False
    marker: bool = False
    enabled: bool = True
    source: str = "<builtin>"
    user: bool = False  # from a run spec: searches only the first MAX_USER_TEXT characters


@dataclass(frozen=True)
class RuleSet:
    """An ordered collection of enabled rules."""

    rules: tuple[Rule, ...]


_KEYS = {"name", "kind", "contains", "words", "regex", "fields", "set", "per_rank", "class", "severity"}
_KEYS |= {"once", "marker", "enabled"}
_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,80}")


#: A rule's severity unless it says (``info`` for any other kind).
_DEFAULT_SEVERITY = {"error": "error", "failed": "error", "shape_check_failed": "error", "warning": "warning"}


def validate_rule(raw: Any, source: str, index: int, user: bool = False) -> Rule:
    """Check one rule dict (``user``: a run spec's, held to check_user_regex); raise RuleError."""
    if not isinstance(raw, dict):
        raise RuleError(source, index, None, f"a rule must be a table/object, got {type(raw).__name__}")

    rule_name = raw.get("name") if isinstance(raw.get("name"), str) else None

    def err(field_name: str | None, message: str) -> RuleError:
        return RuleError(source, index, field_name, message, rule_name)

    if unknown := sorted(set(raw) - _KEYS):
        raise err(unknown[0], f"unknown key (allowed: {', '.join(sorted(_KEYS))})")
    for key in ("name", "kind", "regex"):
        if key not in raw:
            raise err(key, "missing (required)")
        if not isinstance(raw[key], str) or not raw[key]:
            raise err(key, "must be a non-empty string")
    name, kind = raw["name"], raw["kind"]
    if not _NAME_RE.fullmatch(name):
        raise err("name", f"{name!r} must be 1-80 of letters, digits, '_', '.', ':', '-'")
    if kind not in KINDS:
        raise err("kind", f"unknown milestone kind {kind!r} (known: {', '.join(sorted(KINDS))})")
    if user and (unsafe := check_user_regex(raw["regex"])):
        raise err("regex", unsafe)
    try:
        regex = re.compile(raw["regex"])
    except (re.error, RecursionError, OverflowError) as exc:
        raise err("regex", f"does not compile: {exc}") from None
    contains_raw = raw.get("contains", [])
    if isinstance(contains_raw, str):
        contains_raw = [contains_raw]
    if not isinstance(contains_raw, list) or not all(isinstance(c, str) and c for c in contains_raw):
        raise err("contains", "must be a non-empty string or a list of non-empty strings")
    words = raw.get("words", [])
    if isinstance(words, str):
        words = [words]
    if not isinstance(words, list) or not all(isinstance(w, str) and w and w.split() == [w] for w in words):
        raise err("words", "must be a word or a list of words (non-empty, no whitespace)")
    fields = raw.get("fields", {})
    if not isinstance(fields, dict):
        raise err("fields", "must be a table mapping group names to conversions")
    for group, conv in fields.items():
        if conv not in CONVERTERS:
            raise err(
                "fields", f"group {group!r}: unknown conversion {conv!r} (known: {', '.join(CONVERTERS)})"
            )
        if group not in regex.groupindex:
            raise err("fields", f"group {group!r} is not a named group of the regex")
    consts = raw.get("set", {})
    if not isinstance(consts, dict):
        raise err("set", "must be a table of constant fields")
    flags = {key: raw.get(key, key == "enabled") for key in ("per_rank", "once", "marker", "enabled")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise err(key, "must be true or false")
    if flags["marker"] and "json" not in regex.groupindex:
        raise err("regex", "a marker rule needs a named group 'json' holding the JSON object")
    error_class = raw.get("class")
    if kind == "error":
        if error_class not in ERROR_CLASSES:
            raise err("class", f"kind 'error' needs a class, one of {', '.join(sorted(ERROR_CLASSES))}")
    elif error_class is not None:
        raise err("class", f"only rules of kind 'error' take a class (this one is {kind!r})")
    severity = raw.get("severity", _DEFAULT_SEVERITY.get(kind, "info"))
    if severity not in SEVERITIES:
        raise err("severity", f"must be one of {', '.join(SEVERITIES)}")
    return Rule(
        name,
        kind,
        regex,
        contains=tuple(contains_raw),
        words=tuple(words),
        fields=dict(fields),
        set=dict(consts),
        error_class=error_class,
        severity=severity,
        source=source,
        user=user,
        **flags,
    )


def validate_rules(raw_rules: Any, source: str, user: bool = False) -> list[Rule]:
    """Validate a list of rule dicts (a parsed file's ``rule`` array or, ``user``, a run spec's ``rules``)."""
    if not isinstance(raw_rules, list):
        raise RuleError(source, None, "rule", f"expected a list of rules, got {type(raw_rules).__name__}")
    rules = [validate_rule(r, source, i, user) for i, r in enumerate(raw_rules)]
    seen: set[str] = set()
    for i, r in enumerate(rules):
        if r.name in seen:
            raise RuleError(source, i, "name", f"duplicate rule name {r.name!r} in the same source")
        seen.add(r.name)
    return rules


def read_rule_file(path: Path) -> list[Rule]:
    """Parse and validate one TOML (or JSON, by suffix) rule file."""
    source = str(path)
    try:
        data_bytes = path.read_bytes()
    except OSError as exc:
        raise RuleError(source, None, None, f"cannot read: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(data_bytes)
        else:
            data = tomllib.loads(data_bytes.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise RuleError(source, None, None, f"not valid {path.suffix.lstrip('.') or 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise RuleError(source, None, None, "expected a table with a 'rule' array")
    if extra := sorted(set(data) - {"rule"}):
        raise RuleError(source, None, extra[0], "unknown top-level key (expected only [[rule]] tables)")
    return validate_rules(data.get("rule", []), source)


def merge(layers: Iterable[list[Rule]]) -> RuleSet:
    """Combine rule lists in order; a later rule replaces an earlier one of the same name in place."""
    order: list[str] = []
    by_name: dict[str, Rule] = {}
    for layer in layers:
        for rule in layer:
            if rule.name not in by_name:
                order.append(rule.name)
            by_name[rule.name] = rule
    return RuleSet(tuple(by_name[n] for n in order if by_name[n].enabled))


def load_rules(
    extra: list[dict[str, Any]] | None = None, files: Sequence[Path] = (), backend: Backend | None = None
) -> RuleSet:
    """Built-in rules, then rule files, then ``extra`` (a run spec's rules); raises RuleError.

    ``backend``: the run's; eaglewatch's own backends skip the rules for the users' pipelines' lines (None,
    e.g. reading any log: every built-in file)."""
    names = [n for n in BUILTIN_FILES if backend not in OWN or n not in PIPELINE_FILES]
    layers = [read_rule_file(BUILTIN_DIR / name) for name in names]
    layers += [read_rule_file(Path(f)) for f in files]
    if extra:
        layers.append(validate_rules(extra, "spec.rules", user=True))
    return merge(layers)
