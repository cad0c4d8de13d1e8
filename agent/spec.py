"""The run spec: one pydantic model shared by the CLI, the HTTP API, the web form and the extraction job.

Not part of the stdlib-only agent core: the daemon passes specs around as plain dicts; the controller
validates them with this model before launch, and the extraction job (which runs beside vLLM, which
brings pydantic) validates them again on the host.
"""

from __future__ import annotations

import difflib
import re
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    StrictBool,
    StrictInt,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from agent import limits, settings
from agent.backends import DEFAULT, OWN, PIPELINES, Backend
from agent.milestones.rulefile import RuleError, validate_rules
from agent.runs.outdir import output_dir_error

#: Deliberate faults for the demo and the tests: make the capture go wrong the way real runs do.
Fault = Literal["drop_layer", "flatten", "zero", "zero_layer", "batch_skew"]

# Checked with fullmatch: a trailing newline is part of the value, not the end of the line.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Variables the agent sets for its own job processes: a spec's env cannot forge them.
_AGENT_ENV = frozenset(s.name for s in settings.REGISTRY if s.by_agent)

# Bounds come from agent/limits.py (any valid spec fits in one protocol line). Numbers are StrictInt: JSON
# "8" or true is not a tensor-parallel size; the web form converts its own text (web/forms.py).
_Path = Annotated[str, StringConstraints(max_length=limits.MAX_PATH_CHARS)]
_EnvName = Annotated[str, StringConstraints(max_length=limits.MAX_ENV_NAME_CHARS)]
_EnvValue = Annotated[str, StringConstraints(max_length=limits.MAX_ENV_VALUE_CHARS)]
_Arg = Annotated[str, StringConstraints(max_length=limits.MAX_ARG_CHARS)]
_HostName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


def _absolute_path(v: str) -> str | None:
    """An absolute host path (None for empty); the error names the value."""
    if v == "":
        return None
    if "\x00" in v or not PurePosixPath(v).is_absolute():
        raise ValueError(f"must be an absolute path on the host, got {v!r}")
    return v


_AbsPath = Annotated[_Path, AfterValidator(_absolute_path)]


class _Fields(BaseModel):
    """A spec model that refuses an unknown field, suggesting the nearest known one (``modle``: model)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _suggest(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        try:
            return handler(data)
        except ValidationError as exc:
            errors = exc.errors()
            if not any(e["type"] == "extra_forbidden" for e in errors):
                raise
            known = list(cls.model_fields)
            details: list[InitErrorDetails] = []
            for e in errors:
                detail: InitErrorDetails = {"type": e["type"], "loc": e["loc"], "input": e["input"]}
                if e["type"] == "extra_forbidden":
                    # a nested model's error already carries its own suggestion: keep its message
                    text = e["msg"]
                    if len(e["loc"]) == 1:  # the nearest known name when one is close (``modle``: model)
                        close = difflib.get_close_matches(str(e["loc"][0]), known, n=1)
                        text = f"not a spec field: did you mean {close[0]}?" if close else "not a spec field"
                    detail["type"] = PydanticCustomError("extra_forbidden", text)
                elif "ctx" in e:
                    detail["ctx"] = e["ctx"]
                details.append(detail)
            raise ValidationError.from_exception_data(exc.title, details) from None


def eagle3_default_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3 default layer ids in the "input" convention: [2, N//2, N-3, N]."""
    n = num_hidden_layers
    return [2, n // 2, n - 3, n]


class Expect(_Fields):
    """What every captured file should look like; defaults come from the model's config.json."""

    layers: StrictInt | None = Field(
        default=None, ge=1, le=limits.MAX_LAYERS, description="number of captured layers per token"
    )
    hidden_size: StrictInt | None = Field(
        default=None, ge=1, le=limits.MAX_HIDDEN_SIZE, description="hidden size of each captured layer"
    )


_SLURM_JOB_RE = re.compile(r"[0-9]{1,20}")


class Attach(_Fields):
    """Watch a job eaglewatch did not start: by its pid, its log, its output_dir (the spec's) or Slurm job.

    How "the job is alive" is decided: a ``pid`` while it or a descendant runs; a ``slurm_job`` while
    Slurm says so; with neither, until the run is stopped (which only detaches) or ``idle_timeout_s``."""

    pid: StrictInt | None = Field(
        default=None, ge=1, le=1 << 22, description="follow this process and its descendants"
    )
    log: _AbsPath | None = Field(
        default=None, description="absolute path of the job's log file, followed like tail -F"
    )
    from_start: StrictBool = Field(
        default=True, description="take the log's milestones from its first line (false: from now on)"
    )
    slurm_job: str | None = Field(default=None, description="a Slurm job id (digits) on the host")
    allow_stop: StrictBool = Field(
        default=False, description="stop signals the job (or scancels it); without it stop only detaches"
    )
    idle_timeout_s: StrictInt | None = Field(
        default=None,
        ge=1,
        le=30 * 24 * 3600,  # 30 days
        description="end watching after this many seconds with no new log line or file (not for a slurm_job)",
    )

    @field_validator("slurm_job")
    @classmethod
    def _slurm_job(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_JOB_RE.fullmatch(v):
            raise ValueError(f"slurm_job must be a Slurm job id (digits only), got {v[:40]!r}")
        return v

    @model_validator(mode="after")
    def _one_job(self) -> Attach:
        if self.pid is not None and self.slurm_job is not None:
            raise ValueError("attach takes a pid or a slurm_job, not both: name the one that runs the job")
        if self.slurm_job is not None and self.idle_timeout_s is not None:
            raise ValueError(
                "idle_timeout_s does not apply to a slurm_job (Slurm says when it ends): leave it out"
            )
        return self


class Shard(_Fields):
    """One job's part of a sharded run: samples [index*M//count, (index+1)*M//count) of the run's M."""

    index: StrictInt = Field(ge=0, lt=limits.MAX_SHARDS, description="this job's shard, 0-based")
    count: StrictInt = Field(ge=1, le=limits.MAX_SHARDS, description="how many shards the run has")

    @model_validator(mode="after")
    def _index_below_count(self) -> Shard:
        if self.index >= self.count:
            raise ValueError(f"shard index must be below count: got index {self.index} of count {self.count}")
        return self

    def bounds(self, total: int) -> tuple[int, int]:
        """[start, end) of this shard among total samples: contiguous, sizes differing by at most one."""
        return self.index * total // self.count, (self.index + 1) * total // self.count

    def manifest_name(self) -> str:
        """The manifest file this shard writes (the merged one is manifest.json)."""
        return f"manifest.shard-{self.index}-of-{self.count}.json"


def _pass_through(v: list[str], field: str) -> list[str]:
    """Another program's own flags: argv items, never a shell string (same rule as vllm_args)."""
    for arg in v:
        if "\x00" in arg:
            raise ValueError(f"{field} items must not contain NUL bytes")
        problem = limits.option_problem(arg)
        if problem:
            raise ValueError(problem.replace("vllm_args", field, 1))
    return v


class SpeculatorsOptions(_Fields):
    """Backend ``speculators``: a vLLM server started for extraction, then speculators' offline client."""

    scripts_dir: _AbsPath | None = Field(
        default=None,
        description="a speculators checkout's scripts/ (launch_vllm.py, data_generation_offline.py); "
        "default: the installed package (`python -m speculators generate-offline-data`)",
    )
    python: _AbsPath | None = Field(
        default=None, description="the Python that runs both; default the agent's"
    )
    server_command: list[_Arg] = Field(
        default_factory=list,
        max_length=limits.MAX_ARGS,
        description="argv starting the server, before its options, in place of "
        "[python, -m, vllm.entrypoints.openai.api_server, --model, MODEL] (without scripts_dir)",
    )
    port: StrictInt = Field(default=8000, ge=1, le=65535, description="the server's port on 127.0.0.1")
    ready_timeout_s: StrictInt = Field(
        default=1800, ge=1, le=86400, description="wait this long for the server"
    )
    client_args: list[_Arg] = Field(
        default_factory=list,
        max_length=limits.MAX_ARGS,
        description="more client flags, one per item: --validate-outputs, --world-size, --rank…",
    )

    @field_validator("client_args")
    @classmethod
    def _client_args(cls, v: list[str]) -> list[str]:
        return _pass_through(v, "speculators.client_args")

    @field_validator("server_command")
    @classmethod
    def _server_command(cls, v: list[str]) -> list[str]:
        if any("\x00" in a for a in v):
            raise ValueError("speculators.server_command items must not contain NUL bytes")
        problem = limits.program_problem(v)
        if problem:
            raise ValueError(problem.replace("command[0]", "speculators.server_command[0]", 1))
        return v


class SpecForgeOptions(_Fields):
    """Backend ``specforge``: ``torchrun … scripts/prepare_hidden_states.py`` from a SpecForge checkout."""

    scripts_dir: _AbsPath = Field(description="the SpecForge checkout's scripts/ (prepare_hidden_states.py)")
    python: _AbsPath | None = Field(
        default=None, description="the Python that runs torchrun; default the agent's"
    )
    nproc_per_node: StrictInt | None = Field(
        default=None, ge=1, le=limits.MAX_TENSOR_PARALLEL, description="torchrun processes; default tp size"
    )
    args: list[_Arg] = Field(
        default_factory=list,
        max_length=limits.MAX_ARGS,
        description="more prepare_hidden_states.py flags, one per item: --chat-template, --compress…",
    )

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        return _pass_through(v, "specforge.args")


class RunSpec(_Fields):
    """A validated run spec, as stored and sent to the agent: what a user sets to describe an extraction run
    (or any watched command).

    No value is trimmed: argv items and env values pass to the job as written, and names (run, hosts, env
    variables) are checked whole, so stray whitespace is refused with the field named, never dropped.
    """

    name: str = Field(default="run", description="a short label: letters, digits, '.', '_', '-'")
    host: _HostName | list[_HostName] = Field(
        min_length=1,
        description="name of a configured host, or a list of them for a sharded run (controller level)",
    )
    backend: Backend = DEFAULT
    model: _AbsPath | None = Field(
        default=None, description="absolute path of the model directory on the host"
    )
    layers: list[StrictInt] | None = Field(
        default=None,
        max_length=limits.MAX_LAYERS,
        description="layer ids; default EAGLE-3 [2, N//2, N-3, N]",
    )
    layer_convention: Literal["input", "output"] = "input"
    tensor_parallel_size: StrictInt = Field(default=1, ge=1, le=limits.MAX_TENSOR_PARALLEL)
    dataset: _AbsPath | None = Field(default=None, description="absolute path of a JSONL dataset on the host")
    max_samples: StrictInt | None = Field(default=None, ge=1, le=limits.MAX_SAMPLES)
    seq_len: StrictInt = Field(default=2048, ge=1, le=limits.MAX_SEQ_LEN)
    batch_size: StrictInt = Field(default=8, ge=1, le=limits.MAX_BATCH_SIZE)
    output_dir: _Path | None = Field(default=None, description="absolute path on the host for hs_N files")
    env: dict[_EnvName, _EnvValue] = Field(default_factory=dict, max_length=limits.MAX_ENV_VARS)
    vllm_args: list[_Arg] = Field(
        default_factory=list,
        max_length=limits.MAX_ARGS,
        description="extra engine arguments, one per item (never a shell string)",
    )
    command: list[_Arg] = Field(
        default_factory=list,
        max_length=limits.MAX_ARGS,
        description="argv to run without a shell (backend 'command' only)",
    )
    expect: Expect = Field(default_factory=Expect)
    rules: list[dict[str, Any]] = Field(
        default_factory=list, max_length=limits.MAX_RULES, description="extra milestone rules"
    )
    on_shape_failure: Literal["alert", "stop"] = "alert"
    allow_disk_overrun: StrictBool = Field(
        default=False, description="launch even when the forecast says the output will not fit on disk"
    )
    disk_low_gib: StrictInt = Field(
        default=10,
        ge=0,
        le=limits.MAX_DISK_LOW_GIB,
        description="disk_low alert below this many GiB free (or below what is left to write)",
    )
    canary_samples: StrictInt = Field(
        default=2,
        ge=0,
        le=64,
        description="samples captured again alone after the first batch and at the end, to compare (0: off)",
    )
    resume: StrictBool = Field(
        default=False,
        description="carry on in an output_dir holding this capture: keep its files, write the rest",
    )
    inject_fault: Fault | None = Field(default=None, description="demo/testing: corrupt the capture")
    shard: Shard | None = Field(default=None, description="capture only this contiguous slice of the samples")
    speculators: SpeculatorsOptions | None = Field(default=None, description="backend 'speculators' only")
    specforge: SpecForgeOptions | None = Field(default=None, description="backend 'specforge' only")
    attach: Attach | None = Field(
        default=None, description="watch a job eaglewatch did not start (backend 'command', no command)"
    )
    shards: StrictInt = Field(
        default=1,
        ge=1,
        le=limits.MAX_SHARDS,
        description="controller level: split the run into this many shard jobs over the hosts' GPU groups",
    )

    @property
    def hosts(self) -> list[str]:
        """The host names, in order (one for an ordinary run)."""
        return [self.host] if isinstance(self.host, str) else list(self.host)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            if len(v) > limits.MAX_SHARDS:
                raise ValueError(f"at most {limits.MAX_SHARDS} hosts, got {len(v)}")
            repeated = sorted({h for h in v if v.count(h) > 1})
            if repeated:
                raise ValueError(f"host {repeated[0]!r} is listed twice")
        for host in [v] if isinstance(v, str) else v:
            if not _NAME_RE.fullmatch(host):
                raise ValueError(
                    f"host {host!r} is not a host name (letters, digits, '.', '_', '-', starting with a "
                    "letter or digit)"
                )
        return v

    time_limit_minutes: StrictInt | None = Field(
        default=None,
        ge=1,
        le=limits.MAX_TIME_LIMIT_MINUTES,
        description="on a Slurm host: the job's time limit (sbatch --time); the scheduler ends it after",
    )

    @field_validator("rules")
    @classmethod
    def _rules(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # checked here so a bad rule is a 422 naming it, not a launch failure on the host
        try:
            validate_rules(v, "spec.rules", user=True)
        except RuleError as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError(
                f"name must be 1-64 of letters, digits, '.', '_', '-' and start with a letter/digit: {v!r}"
            )
        return v

    @field_validator("output_dir")
    @classmethod
    def _output_dir(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        err = output_dir_error(v)
        if err is not None:
            raise ValueError(err)
        return v

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("layers must not be empty (leave it out for the EAGLE-3 default)")
        if any(i < 0 for i in v):
            raise ValueError(f"layer ids must be >= 0, got {v}")
        if any(i > limits.MAX_LAYER_ID for i in v):
            raise ValueError(f"layer ids must be at most {limits.MAX_LAYER_ID}, got {max(v)}")
        if len(set(v)) != len(v):
            raise ValueError(f"layer ids must be unique, got {v}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_RE.fullmatch(key):
                raise ValueError(
                    f"environment variable name {key!r} is not valid (letters, digits, '_', not starting "
                    "with a digit)"
                )
            if key in _AGENT_ENV:
                raise ValueError(f"environment variable {key} is set by the agent, not by a spec")
            if "\x00" in value:
                raise ValueError(f"environment variable {key!r} contains a NUL byte")
        return v

    @field_validator("vllm_args", "command")
    @classmethod
    def _argv(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if any("\x00" in a for a in v):
            raise ValueError("arguments must not contain NUL bytes")
        if info.field_name == "command":
            problems = [limits.program_problem(v)]
        else:
            problems = [limits.option_problem(arg) for arg in v]
        if problem := next((p for p in problems if p), None):
            raise ValueError(problem)
        return v

    @model_validator(mode="before")
    @classmethod
    def _attach_backend(cls, data: Any) -> Any:
        # An attached job is watched as a command (every rule file applies): the backend need not be named.
        if isinstance(data, dict) and data.get("attach") is not None and "backend" not in data:
            return {**data, "backend": Backend.COMMAND.value}
        return data

    @model_validator(mode="after")
    def _attached(self) -> RunSpec:
        if self.attach is None:
            return self
        a = self.attach
        if self.backend != Backend.COMMAND:
            raise ValueError(f"attach watches the job as backend '{Backend.COMMAND}': leave 'backend' out")
        if self.command:
            raise ValueError("attach watches a job that already runs: leave 'command' out")
        if a.pid is None and a.log is None and a.slurm_job is None and self.output_dir is None:
            raise ValueError(
                "attach needs something to watch: attach.pid, attach.log, attach.slurm_job or output_dir"
            )
        if self.shards > 1 or self.shard is not None or self.resume:
            raise ValueError("attach watches one job as it is: 'shards', 'shard' and 'resume' do not apply")
        if self.on_shape_failure == "stop" and not a.allow_stop:
            raise ValueError(
                "on_shape_failure 'stop' would stop a job eaglewatch did not start: set attach.allow_stop "
                "or use 'alert'"
            )
        return self

    @model_validator(mode="after")
    def _backend_fields(self) -> RunSpec:
        backend = self.backend
        if backend == Backend.COMMAND:
            if not self.command and self.attach is None:
                raise ValueError(f"backend '{backend}' needs 'command' (an argv list)")
            if self.shard is not None or self.shards > 1:
                raise ValueError(f"'shard' and 'shards' need an extraction backend ({' or '.join(OWN)})")
        else:
            if self.command:
                raise ValueError(
                    f"'command' is only allowed with backend '{Backend.COMMAND}', not '{backend}'"
                )
            missing = [f for f in ("model", "dataset", "output_dir") if getattr(self, f) is None]
            if backend == Backend.SPECFORGE and self.specforge is None:
                missing.append("specforge (its scripts_dir at least)")
            if missing:
                raise ValueError(f"backend '{backend}' needs {', '.join(missing)}")
        for name in PIPELINES:  # each pipeline's options field is named after it
            if getattr(self, name) is not None and backend != name:
                raise ValueError(f"'{name}' is only allowed with backend '{name}', not '{backend}'")
        if backend == Backend.SPECFORGE and self.layers is not None:
            raise ValueError(
                f"backend '{backend}' takes its layers from its draft model config: leave 'layers' out "
                "(pass --draft-model-config in specforge.args)"
            )
        if backend in PIPELINES and (self.shard is not None or self.shards > 1):
            raise ValueError(
                f"'shard' and 'shards' are eaglewatch's slicing; backend '{backend}' splits work with "
                "its own flags (speculators: client_args --world-size/--rank)"
            )
        return self

    @model_validator(mode="after")
    def _shards(self) -> RunSpec:
        if self.shards > 1 and self.shard is not None:
            raise ValueError(
                "a spec sets 'shards' (the controller splits the run) or 'shard' (one job), not both"
            )
        if len(self.hosts) > self.shards:
            raise ValueError(
                f"shards is {self.shards} but {len(self.hosts)} hosts are given: each needs a shard"
            )
        if isinstance(self.host, list) and len(self.host) == 1 and self.shards == 1:
            self.host = self.host[0]  # an ordinary run: the agent and the run row see one name
        return self

    @model_validator(mode="after")
    def _fits_one_line(self) -> RunSpec:
        # The controller sends the spec, defaults filled in, in one launch line the agent reads whole.
        problem = limits.spec_size_problem(self.model_dump(mode="json"))
        if problem:
            raise ValueError(problem)
        return self


def parse_spec(data: dict[str, Any]) -> RunSpec:
    """Validate a spec dict; raises pydantic.ValidationError naming each bad field."""
    return RunSpec.model_validate(data)
