"""The New-run form: pure conversion between posted form fields and a run spec, with per-field errors."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from agent.backends import DEFAULT, PIPELINES, Backend
from agent.spec import RunSpec, parse_spec
from web.filters import is_secret_name

#: Form fields in display order (text inputs unless noted in the template).
FIELDS = (
    "name", "host", "backend", "model", "layers", "layer_convention", "tensor_parallel_size", "dataset",
    "max_samples", "seq_len", "batch_size", "output_dir", "env", "vllm_args", "command",
    "expect_layers", "expect_hidden_size", "on_shape_failure", "inject_fault", "disk_low_gib",
    "allow_disk_overrun", "shards", "time_limit_minutes", "pipeline_scripts_dir", "pipeline_python",
    "pipeline_args", "server_port", "nproc_per_node", "attach", "attach_pid", "attach_log",
    "attach_from_start", "attach_slurm_job", "attach_allow_stop", "attach_idle_timeout_s",
)  # fmt: skip
#: The Attach fieldset's selects: form text → the attach option's value ("" leaves the default).
_ATTACH_CHOICES = {"attach_from_start": {"false": False}, "attach_allow_stop": {"true": True}}
#: Form field → (backend's options key, option) for the speculators / SpecForge options.
_PIPELINE_FIELDS: dict[str, dict[str, str]] = {
    "pipeline_scripts_dir": {Backend.SPECULATORS: "scripts_dir", Backend.SPECFORGE: "scripts_dir"},
    "pipeline_python": {Backend.SPECULATORS: "python", Backend.SPECFORGE: "python"},
    "pipeline_args": {Backend.SPECULATORS: "client_args", Backend.SPECFORGE: "args"},
    "server_port": {Backend.SPECULATORS: "port"},
    "nproc_per_node": {Backend.SPECFORGE: "nproc_per_node"},
}
_INT_FIELDS = (
    "tensor_parallel_size", "max_samples", "seq_len", "batch_size", "disk_low_gib", "shards",
    "time_limit_minutes",
)  # fmt: skip
#: The errors key of a message that belongs to no one field (shown above the form).
GENERAL_ERROR_KEY = "_form"
#: A whole number as typed: ASCII digits only (int() would also take "1_000" and other scripts' digits).
_WHOLE_RE = re.compile(r"[+-]?[0-9]{1,30}", re.ASCII)


def _whole(text: str, key: str, errors: dict[str, str], label: str | None = None) -> int | None:
    """The form's text as an int, or None with an error under ``key``: the spec model is strict, so text is
    converted here, never coerced there."""
    if _WHOLE_RE.fullmatch(text):
        return int(text)
    what = key.removeprefix("attach_").replace("_", " ") if label is None else label
    errors[key] = f"{what} must be a whole number, got {text!r}".lstrip()
    return None


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def form_to_spec(form: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Turn posted form fields into a spec dict; returns (spec, errors by form field)."""
    errors: dict[str, str] = {}
    spec: dict[str, Any] = {}
    get = lambda key: (form.get(key) or "").strip()  # noqa: E731
    for key in ("name", "host", "backend", "model", "layer_convention", "dataset", "output_dir",
                "on_shape_failure", "inject_fault"):  # fmt: skip
        if get(key):
            spec[key] = get(key)
    if "," in get("host"):  # the host multi-select posts several names (web/pages.py joins them)
        spec["host"] = [h.strip() for h in get("host").split(",") if h.strip()]
    for key in _INT_FIELDS:
        if get(key) and (whole := _whole(get(key), key, errors)) is not None:
            spec[key] = whole
    if get("layers"):
        parts = [p.strip() for p in re.split(r"[,\s]+", get("layers")) if p.strip()]
        if all(_WHOLE_RE.fullmatch(p) for p in parts):
            spec["layers"] = [int(p) for p in parts]
        else:
            errors["layers"] = f"layer ids must be whole numbers separated by commas, got {get('layers')!r}"
    expect: dict[str, int] = {}
    for key, target in (("expect_layers", "layers"), ("expect_hidden_size", "hidden_size")):
        if get(key) and (whole := _whole(get(key), key, errors, label="")) is not None:
            expect[target] = whole
    if expect:
        spec["expect"] = expect
    if get("allow_disk_overrun"):  # a select: "" (no) or "true"
        spec["allow_disk_overrun"] = get("allow_disk_overrun") == "true"
    env: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate((form.get("env") or "").splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep:
            errors["env"] = f"each line must be NAME=value, got {line!r}"
            break
        key = key.strip()
        if key in first_line:
            # Keeping the last value silently would launch with a setting the user may not see.
            errors["env"] = (
                f"{key} is set twice (lines {first_line[key]} and {number}); set each variable once"
            )
            break
        if is_secret_name(key) and not value.strip():
            # secret values are never saved in templates nor sent back: an empty one must be typed again
            errors["env"] = f"{key} has no value: type it (secret values are never saved or shown)"
            break
        first_line[key] = number
        env[key] = value.strip()
    if env:
        spec["env"] = env
    for key in ("vllm_args", "command"):
        if _lines(form.get(key) or ""):
            spec[key] = _lines(form.get(key) or "")
    _pipeline_options(form, spec, errors)
    _attach_options(form, spec, errors)
    return spec, errors


def _attach_options(form: Mapping[str, str], spec: dict[str, Any], errors: dict[str, str]) -> None:
    """The Attach fieldset as the spec's ``attach`` (when its select says so or a job is named).  An
    attached job is watched as a command, so the backend select's untouched default is dropped (a backend
    chosen on purpose is kept, and refused)."""
    jobs = ("attach_pid", "attach_log", "attach_slurm_job", "attach_idle_timeout_s")
    named = {key: text for key in jobs if (text := (form.get(key) or "").strip())}
    if not named and (form.get("attach") or "").strip() != "yes":  # "yes": only an output_dir to watch
        return
    attach: dict[str, Any] = {}
    for key, text in named.items():
        value = _whole(text, key, errors) if key in ("attach_pid", "attach_idle_timeout_s") else text
        if value is not None:
            attach[key.removeprefix("attach_")] = value
    for key, values in _ATTACH_CHOICES.items():
        if (choice := values.get((form.get(key) or "").strip())) is not None:
            attach[key.removeprefix("attach_")] = choice
    spec["attach"] = attach
    if spec.get("backend") == DEFAULT:
        del spec["backend"]


def _pipeline_options(form: Mapping[str, str], spec: dict[str, Any], errors: dict[str, str]) -> None:
    """The speculators / SpecForge options of the form, under the backend's key (fields of others ignored)."""
    backend = spec.get("backend")
    if backend not in PIPELINES:
        return
    options: dict[str, Any] = {}
    for key, names in _PIPELINE_FIELDS.items():
        option, text = names.get(backend), (form.get(key) or "").strip()
        if option is None or not text:
            continue
        if key == "pipeline_args":
            options[option] = _lines(text)
        elif key not in ("server_port", "nproc_per_node"):
            options[option] = text
        elif (whole := _whole(text, key, errors)) is not None:
            options[option] = whole
    if options or backend == Backend.SPECFORGE:
        spec[backend] = options


def without_secret_values(values: Mapping[str, str]) -> dict[str, str]:
    """Form values with the values of secret-looking env names emptied (``HF_TOKEN=``): what may be
    saved in a template or sent back in a page."""
    out = dict(values)
    lines = []
    for line in (values.get("env") or "").splitlines():
        key, sep, _value = line.partition("=")
        lines.append(f"{key}=" if sep and is_secret_name(key.strip()) else line)
    if "env" in values:
        out["env"] = "\n".join(lines)
    return out


def spec_to_form(spec: Mapping[str, Any]) -> dict[str, str]:
    """Form field values for a spec (to re-fill the form from a template or after an error)."""
    out: dict[str, str] = {}
    for key in FIELDS:
        value = spec.get(key)
        if key == "layers" and value:
            out[key] = ", ".join(str(i) for i in value)
        elif key == "env" and value:
            out[key] = "\n".join(f"{k}={v}" for k, v in value.items())
        elif key in ("vllm_args", "command") and value:
            out[key] = "\n".join(str(a) for a in value)
        elif key in ("expect_layers", "expect_hidden_size"):
            expect = spec.get("expect") or {}
            inner = expect.get(key.removeprefix("expect_"))
            out[key] = "" if inner is None else str(inner)
        elif key == "host" and isinstance(value, list):
            out[key] = ",".join(value)
        elif key == "allow_disk_overrun":
            out[key] = "true" if value is True else ""
        elif key.startswith("attach"):
            attach = spec.get("attach")
            if isinstance(attach, dict):
                inner = attach.get(key.removeprefix("attach_")) if key != "attach" else "yes"
                if key in _ATTACH_CHOICES:  # a select: the option whose value it is, "" for the default
                    inner = next((t for t, v in _ATTACH_CHOICES[key].items() if v is inner), None)
                out[key] = "" if inner is None else str(inner)
        elif key in _PIPELINE_FIELDS:
            backend = spec.get("backend")
            options = spec.get(backend) if isinstance(backend, str) else None
            option = _PIPELINE_FIELDS[key].get(backend) if isinstance(backend, str) else None
            inner = options.get(option) if isinstance(options, dict) and option else None
            if isinstance(inner, list):
                out[key] = "\n".join(str(a) for a in inner)
            elif inner is not None:
                out[key] = str(inner)
        elif value is not None and not isinstance(value, (dict, list)):
            out[key] = str(value)
    return out


def _field_of(loc: tuple[Any, ...], message: str) -> list[str]:
    """Which form fields a pydantic error location (or, for model-level errors, its message) names."""
    if loc:
        head = str(loc[0])
        if head == "expect" and len(loc) > 1:
            return [f"expect_{loc[1]}"]
        if head == "attach" and len(loc) > 1:
            return [f"attach_{loc[1]}"] if f"attach_{loc[1]}" in FIELDS else [GENERAL_ERROR_KEY]
        if head in PIPELINES and len(loc) > 1:
            named = [k for k, names in _PIPELINE_FIELDS.items() if names.get(head) == str(loc[1])]
            return named or [GENERAL_ERROR_KEY]
        return [head] if head in FIELDS else [GENERAL_ERROR_KEY]
    named = [f for f in FIELDS if re.search(rf"\b{re.escape(f)}\b", message)]
    named = [f for f in named if f != "backend"] or named
    return named or [GENERAL_ERROR_KEY]


def validation_errors(exc: ValidationError) -> list[dict[str, str]]:
    """Pydantic errors as ``[{"field", "message"}]`` (``field`` dotted, '' for whole-spec errors)."""
    out = []
    for err in exc.errors():
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        field = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        out.append({"field": field, "message": msg})
    return out


def errors_by_form_field(errors: list[dict[str, str]]) -> dict[str, str]:
    """Map ``[{"field", "message"}]`` onto form fields, so each message shows next to its input."""
    out: dict[str, str] = {}
    for err in errors:
        loc = tuple(p for p in err.get("field", "").split(".") if p)
        for name in _field_of(loc, err["message"]):
            # a message shown above the form names the spec field it is about (``modle: … model?``)
            general = name == GENERAL_ERROR_KEY and loc
            message = f"{err['field']}: {err['message']}" if general else err["message"]
            out[name] = f"{out[name]}; {message}" if name in out else message
    return out


def check_form(form: Mapping[str, str]) -> tuple[RunSpec | None, dict[str, str]]:
    """The form's validated spec and no errors, or None and every error by field."""
    spec, errors = form_to_spec(form)
    try:
        parsed = parse_spec(spec)
    except ValidationError as exc:
        for name, message in errors_by_form_field(validation_errors(exc)).items():
            errors.setdefault(name, message)  # a field that did not even parse keeps its own message
        return None, errors
    # a field the form could not convert was left out of the spec, which may still be valid without it
    return (None, errors) if errors else (parsed, {})


def field_help() -> dict[str, str]:
    """Descriptions of spec fields, shown under the inputs."""
    return {name: (f.description or "") for name, f in RunSpec.model_fields.items()}
