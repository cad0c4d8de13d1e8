"""Known vLLM capture bugs (known_bugs.toml) matched against the host's vLLM, the model and the backend.

Pure: the facts of a run are a `Target`; the preflight turns a refusal into a failed job.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from agent import backends, settings
from agent.backends import Backend
from agent.extract.engine.runtime import parse_version

DEFAULT_FILE = Path(__file__).with_name("known_bugs.toml")
#: Facts of a run a bug entry may require (its `when`). "aux_outputs": the capture reads vLLM's EAGLE-3 aux
#: hidden-state outputs (vllm-native always; the worker extension only on its compiled "aux" path, which is
#: chosen after the preflight, so bugs that need it are handed to that choice: `aux_path_bugs`).
CONDITIONS = frozenset({"captures_final_layer", "vlm_wrapper", "aux_outputs"})
Severity = Literal["warning", "refuse"]
Version = tuple[int, int, int]


class BugTableError(ValueError):
    """The known-bug table is malformed; the message names the entry and the field."""


@dataclass(frozen=True)
class KnownBug:
    """One known bug: where it applies (versions, architectures, backends, conditions) and what to say."""

    id: str
    severity: Severity
    message: str
    link: str
    vllm_min: Version | None = None
    vllm_below: Version | None = None
    archs: frozenset[str] = frozenset()
    backends: frozenset[Backend] = frozenset()
    when: frozenset[str] = frozenset()

    def describe(self) -> str:
        """One line for a milestone or an error: id, message and link."""
        return f"known vLLM bug {self.id}: {self.message} ({self.link})"


@dataclass(frozen=True)
class Target:
    """What the preflight knows about a run before any engine starts."""

    vllm_version: str
    archs: tuple[str, ...]
    backend: Backend
    conditions: frozenset[str]


def _version(entry: str, key: str, value: Any) -> Version | None:
    if value is None:
        return None
    parsed = parse_version(value) if isinstance(value, str) else None
    if parsed is None:
        raise BugTableError(f"known bug {entry}: {key} {value!r} is not a version like '0.25.0'")
    return parsed


def _names(entry: str, key: str, value: Any, allowed: frozenset[str] | None = None) -> frozenset[str]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BugTableError(f"known bug {entry}: {key} must be a list of names")
    unknown = set(value) - allowed if allowed is not None else set()
    if unknown:
        raise BugTableError(
            f"known bug {entry}: unknown {key} {sorted(unknown)}; expected {sorted(allowed or ())}"
        )
    return frozenset(value)


def _backends(entry: str, value: Any) -> frozenset[Backend]:
    """An entry's backends: eaglewatch's own capture backends only (the others run no capture of ours)."""
    try:
        return frozenset(backends.parse(v, f"known bug {entry}: backends", backends.OWN) for v in value or ())
    except backends.UnknownBackend as e:
        raise BugTableError(str(e)) from None


def parse_bugs(data: Mapping[str, Any]) -> list[KnownBug]:
    """Known bugs from a parsed TOML table `{"bug": [...]}`; BugTableError names a bad entry."""
    fields = {"id", "severity", "message", "link", "vllm_min", "vllm_below", "archs", "backends", "when"}
    bugs: list[KnownBug] = []
    for i, raw in enumerate(data.get("bug", [])):
        name = str(raw.get("id", f"#{i + 1}")) if isinstance(raw, dict) else f"#{i + 1}"
        if not isinstance(raw, dict):
            raise BugTableError(f"known bug {name}: must be a table")
        extra = set(raw) - fields
        if extra:
            raise BugTableError(f"known bug {name}: unknown field(s) {sorted(extra)}")
        for key in ("id", "message", "link"):
            if not isinstance(raw.get(key), str) or not raw[key]:
                raise BugTableError(f"known bug {name}: {key} must be a non-empty string")
        severity = raw.get("severity")
        if severity not in ("warning", "refuse"):
            raise BugTableError(f"known bug {name}: severity must be 'warning' or 'refuse', got {severity!r}")
        bugs.append(
            KnownBug(
                id=raw["id"],
                severity=severity,
                message=raw["message"],
                link=raw["link"],
                vllm_min=_version(name, "vllm_min", raw.get("vllm_min")),
                vllm_below=_version(name, "vllm_below", raw.get("vllm_below")),
                archs=_names(name, "archs", raw.get("archs")),
                backends=_backends(name, _names(name, "backends", raw.get("backends"))),
                when=_names(name, "when", raw.get("when"), CONDITIONS),
            )
        )
    ids = [b.id for b in bugs]
    dup = sorted({x for x in ids if ids.count(x) > 1})
    if dup:
        raise BugTableError(f"known bug ids repeated: {dup}")
    return bugs


def load_bugs(path: Path = DEFAULT_FILE) -> list[KnownBug]:
    """The known-bug table from a TOML file (default: the one shipped with the agent)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise BugTableError(f"{path}: {e}") from None
    return parse_bugs(data)


def target_for(
    version: str, config: Mapping[str, Any], backend: Backend, layer_ids: Iterable[int], convention: str
) -> Target:
    """The Target of a run from its (text-merged) config.json: a wrapper's own architecture and its language
    model's both count, since a known bug may name either."""
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    inner = config.get("text_config")
    inner_archs = inner.get("architectures") if isinstance(inner, dict) else None
    archs += [a for a in inner_archs or [] if isinstance(a, str) and a not in archs]
    n = int(config["num_hidden_layers"])
    conditions = set()
    if (n if convention == "input" else n - 1) in set(layer_ids):
        conditions.add("captures_final_layer")
    if isinstance(inner, dict):
        conditions.add("vlm_wrapper")
    if backend == Backend.VLLM_NATIVE:
        conditions.add("aux_outputs")
    return Target(version, tuple(archs), backend, frozenset(conditions))


def with_aux(target: Target) -> Target:
    """The same run, capturing through vLLM's aux outputs (the worker extension's compiled path)."""
    return replace(target, conditions=target.conditions | {"aux_outputs"})


def aux_path_bugs(bugs: Iterable[KnownBug], target: Target) -> list[KnownBug]:
    """The bugs that apply only if this run reads vLLM's aux outputs: the worker extension then captures
    through its layer hooks instead (agent/extract/engine/runtime.py choose_capture)."""
    aux = with_aux(target)
    return [b for b in bugs if applies(b, aux) and not applies(b, target)]


def applies(bug: KnownBug, target: Target) -> bool:
    """Whether one bug applies; a version that cannot be parsed matches no version range."""
    if bug.vllm_min is not None or bug.vllm_below is not None:
        v = parse_version(target.vllm_version)
        if v is None:
            return False
        if bug.vllm_min is not None and v < bug.vllm_min:
            return False
        if bug.vllm_below is not None and v >= bug.vllm_below:
            return False
    if bug.archs and not bug.archs.intersection(target.archs):
        return False
    if bug.backends and target.backend not in bug.backends:
        return False
    return bug.when <= target.conditions


def match(bugs: Iterable[KnownBug], target: Target) -> list[KnownBug]:
    """Every known bug that applies to the target, in table order."""
    return [b for b in bugs if applies(b, target)]


def aux_refusal(bugs: Iterable[KnownBug], target: Target, allowed: frozenset[str]) -> str | None:
    """Why vLLM's aux outputs would be wrong for ``target``, short enough for a milestone field: each refusing
    bug not allowed, by id and link, and the setting that keeps the aux path; None when none applies."""
    named = [b for b in match(bugs, target) if b.severity == "refuse" and b.id not in allowed]
    if not named:
        return None
    said = "; ".join(f"known vLLM bug {b.id}, {b.link}" for b in named)
    return f"{said}; {settings.ALLOW_KNOWN_BUGS.name}={','.join(b.id for b in named)} keeps them"


def gate(bugs: Iterable[KnownBug], target: Target, allowed: frozenset[str]) -> tuple[list[str], list[str]]:
    """(refusals, warnings) as message lines; an allowed refusal becomes a warning that says so."""
    refusals: list[str] = []
    warnings: list[str] = []
    for bug in match(bugs, target):
        if bug.severity == "refuse" and bug.id not in allowed:
            refusals.append(
                f"{bug.describe()}. Use a fixed vLLM, or set {settings.ALLOW_KNOWN_BUGS.name}={bug.id} in "
                "the spec's env if your build carries the fix"
            )
        elif bug.severity == "refuse":
            warnings.append(f"{bug.describe()}; capturing anyway ({settings.ALLOW_KNOWN_BUGS.name})")
        else:
            warnings.append(bug.describe())
    return refusals, warnings
