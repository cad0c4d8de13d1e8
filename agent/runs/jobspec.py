"""What the daemon reads of a run spec: a typed stdlib view with agent/spec.py's defaults, checked once.

agent/spec.py (pydantic) is the full model and stays out of the daemon; this view holds only the fields the
daemon acts on. ``JobSpec.parse`` is strict about what a launch acts on (backend, env, command, rules,
on_shape_failure, output_dir, shard, time_limit_minutes, attach: SpecError naming the field) and holds
them, and the spec's size, to the bounds of agent/limits.py that agent/spec.py enforces too: a spec the API
accepts is one the daemon launches. Any other field, and every field of ``JobSpec.stored`` (a spec.json
already launched), falls back to its default when it cannot be read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent import backends, limits
from agent.backends import Backend
from agent.runs.outdir import output_dir_error

SHAPE_FAILURE_POLICIES = ("alert", "stop")


class SpecError(ValueError):
    """A spec field the daemon cannot act on; the message names the field."""


def _backend(value: Any) -> Backend:
    try:
        return backends.parse(value, "spec.backend")
    except backends.UnknownBackend as e:
        raise SpecError(str(e)) from None


def _env(value: Any) -> dict[str, str]:
    value = value or {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k.isidentifier() and isinstance(v, str) and "\0" not in v
        for k, v in value.items()
    ):
        raise SpecError("spec.env must map variable names to strings")
    if len(value) > limits.MAX_ENV_VARS:
        raise SpecError(f"spec.env has {len(value)} variables; at most {limits.MAX_ENV_VARS}")
    for k, v in value.items():
        if len(k) > limits.MAX_ENV_NAME_CHARS or len(v) > limits.MAX_ENV_VALUE_CHARS:
            raise SpecError(
                f"spec.env {k[:40]!r}: names have at most {limits.MAX_ENV_NAME_CHARS} characters, "
                f"values at most {limits.MAX_ENV_VALUE_CHARS}"
            )
    return dict(value)


def _shard(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    index, count = (value.get("index"), value.get("count")) if isinstance(value, dict) else (None, None)
    if not (type(index) is int and type(count) is int and 0 <= index < count <= limits.MAX_SHARDS):
        raise SpecError(
            f"spec.shard must be {{'index': I, 'count': N}} with 0 <= I < N <= {limits.MAX_SHARDS}"
        )
    return index, count


def _policy(value: Any) -> str:
    if value not in SHAPE_FAILURE_POLICIES:
        raise SpecError("spec.on_shape_failure must be 'alert' or 'stop'")
    return str(value)


def _argv(value: Any) -> list[str]:
    value = value or []
    if not isinstance(value, list) or not all(isinstance(a, str) and "\0" not in a for a in value):
        raise SpecError("spec.command must be a list of strings")
    if len(value) > limits.MAX_ARGS or any(len(a) > limits.MAX_ARG_CHARS for a in value):
        raise SpecError(
            f"spec.command has at most {limits.MAX_ARGS} items of at most {limits.MAX_ARG_CHARS} characters"
        )
    problem = limits.program_problem(value)
    if problem:
        raise SpecError(f"spec.{problem}")
    return list(value)


def _rules(value: Any) -> list[dict[str, Any]]:
    value = value or []
    if not isinstance(value, list):
        raise SpecError("spec.rules must be a list of rules")
    if len(value) > limits.MAX_RULES:
        raise SpecError(f"spec.rules has {len(value)} rules; at most {limits.MAX_RULES}")
    return list(value)


def _count(value: Any) -> int | None:
    """A positive integer, else None: the fields a launch does not act on fall back to their defaults."""
    return value if type(value) is int and value >= 1 else None


def _minutes(value: Any) -> int | None:
    if value is not None and _count(value) is None:
        raise SpecError("spec.time_limit_minutes must be a positive integer")
    return value


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _output_dir(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise SpecError("spec.output_dir must be a string")
    err = output_dir_error(value)
    if err is not None:
        raise SpecError(f"spec.{err}")
    return value


@dataclass(frozen=True)
class AttachSpec:
    """A spec's ``attach``: the job the agent watches but did not start (agent/spec.py ``Attach``)."""

    pid: int | None = None
    log: str | None = None
    from_start: bool = True
    slurm_job: str | None = None
    allow_stop: bool = False
    idle_timeout_s: int | None = None


def _attach(value: Any) -> AttachSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SpecError("spec.attach must be an object")
    pid, log, job = value.get("pid"), value.get("log"), value.get("slurm_job")
    idle = value.get("idle_timeout_s")
    if pid is not None and (type(pid) is not int or pid < 1):
        raise SpecError("spec.attach.pid must be a process id")
    if log is not None and not (isinstance(log, str) and log.startswith("/") and "\0" not in log):
        raise SpecError("spec.attach.log must be an absolute path")
    if job is not None and not (isinstance(job, str) and job.isascii() and job.isdigit() and len(job) <= 20):
        raise SpecError("spec.attach.slurm_job must be a Slurm job id (digits)")
    if pid is not None and job is not None:
        raise SpecError("spec.attach takes a pid or a slurm_job, not both")
    if idle is not None and (type(idle) is not int or idle < 1):
        raise SpecError("spec.attach.idle_timeout_s must be a positive number of seconds")
    return AttachSpec(
        pid=pid,
        log=log,
        from_start=value.get("from_start", True) is not False,
        slurm_job=job,
        allow_stop=value.get("allow_stop") is True,
        idle_timeout_s=idle,
    )


@dataclass(frozen=True)
class JobSpec:
    """The fields of a run spec the daemon uses; defaults as in agent/spec.py."""

    name: str | None = None
    backend: Backend = backends.DEFAULT
    tensor_parallel_size: int = 1
    model: str | None = None
    layers: list[int] | None = None
    output_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    rules: list[dict[str, Any]] = field(default_factory=list)
    on_shape_failure: str = "alert"
    expect_layers: int | None = None
    expect_hidden_size: int | None = None
    #: (index, count) of a sharded run's job: it writes its own slice of hs_N files into output_dir
    shard: tuple[int, int] | None = None
    #: the scheduler's time limit for the job (Slurm --time); ignored for a job the agent starts itself
    time_limit_minutes: int | None = None
    #: the run carries on in an output_dir that already holds its capture's files
    resume: bool = False
    #: a job the agent did not start, watched as it is (None: the agent starts the job)
    attach: AttachSpec | None = None

    @classmethod
    def parse(cls, spec: Any) -> JobSpec:
        """The view of a spec about to be launched; SpecError names the first bad field."""
        if not isinstance(spec, dict):
            raise SpecError("'spec' must be a JSON object (a run spec)")
        problem = limits.spec_size_problem(spec)
        if problem:
            raise SpecError(f"spec: {problem}")
        view = cls._read(spec, strict=True)
        if view.backend == Backend.COMMAND and not view.command and view.attach is None:
            raise SpecError("backend 'command' needs spec.command: a non-empty list of strings")
        if view.attach is not None and (view.command or view.backend != Backend.COMMAND):
            raise SpecError("spec.attach watches a running job: no spec.command, backend 'command'")
        return view

    @classmethod
    def stored(cls, spec: Any) -> JobSpec:
        """The view of a launched run's spec.json; a field it cannot read keeps its default."""
        return cls._read(spec if isinstance(spec, dict) else {}, strict=False)

    @classmethod
    def _read(cls, spec: dict[str, Any], strict: bool) -> JobSpec:
        defaults = cls()

        def get(name: str, read: Callable[[Any], Any], raw: Any) -> Any:
            try:
                return read(raw)
            except SpecError:
                if strict:
                    raise
                return getattr(defaults, name)

        expect = spec.get("expect")
        expect = expect if isinstance(expect, dict) else {}
        layers = spec.get("layers")
        return cls(
            name=_text(spec.get("name")),
            # an attached job is watched as a command (agent/spec.py says so too)
            backend=get(
                "backend",
                _backend,
                spec.get("backend", Backend.COMMAND if spec.get("attach") is not None else defaults.backend),
            ),
            tensor_parallel_size=_count(spec.get("tensor_parallel_size")) or defaults.tensor_parallel_size,
            model=_text(spec.get("model")),
            layers=list(layers) if isinstance(layers, list) and all(type(i) is int for i in layers) else None,
            output_dir=get("output_dir", _output_dir, spec.get("output_dir")),
            env=get("env", _env, spec.get("env")),
            command=get("command", _argv, spec.get("command")),
            rules=get("rules", _rules, spec.get("rules")),
            on_shape_failure=get(
                "on_shape_failure", _policy, spec.get("on_shape_failure", defaults.on_shape_failure)
            ),
            expect_layers=_count(expect.get("layers")),
            expect_hidden_size=_count(expect.get("hidden_size")),
            shard=get("shard", _shard, spec.get("shard")),
            time_limit_minutes=get("time_limit_minutes", _minutes, spec.get("time_limit_minutes")),
            resume=spec.get("resume") is True,
            attach=get("attach", _attach, spec.get("attach")),
        )

    @property
    def world_size(self) -> int | None:
        """TP ranks the extraction job runs (closes per-rank groups at once); unknown for a command."""
        # SpecForge's torchrun ranks print no vLLM rank prefixes: its lines never form rank groups
        return None if self.backend in (Backend.COMMAND, Backend.SPECFORGE) else self.tensor_parallel_size
