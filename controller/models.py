"""SQLModel tables (the SQLite schema), the inputs the facade takes and the public shapes it returns.

Layering as in the FastAPI template: ``HostCreate`` (input) → ``Host`` (table) → ``HostPublic`` (output);
a run's input is the ``RunSpec`` (agent/spec.py), validated once where it enters (``parse_run_spec``).
JSON columns are stored as TEXT and decoded into the public models.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic import Field as PField
from sqlalchemy import Index, UniqueConstraint
from sqlmodel import Field, SQLModel

from agent.sched.options import sbatch_arg_problem, slurm_name_problem
from agent.spec import RunSpec
from controller.errors import SpecInvalid

#: The schema this controller writes; it refuses a database of a newer one.
SCHEMA_VERSION = 2

RUN_STATES = ("pending", "starting", "running", "completed", "failed", "stopped", "lost", "unknown")


class SchemaVersion(SQLModel, table=True):
    """One row: the schema version this database was created or migrated to."""

    __tablename__ = "schema_version"
    version: int = Field(primary_key=True)


class Host(SQLModel, table=True):
    """A GPU host reached over SSH."""

    __tablename__ = "hosts"
    name: str = Field(primary_key=True)
    ssh: str
    python: str = "python3"
    state_dir: str | None = None
    created_at: float
    reachable: bool | None = None
    last_seen: float | None = None
    unreachable_since: float | None = None
    agent_version: str | None = None
    fingerprint: str | None = None
    gpus_json: str = "[]"
    last_error: str | None = None
    scheduler: str | None = None  # "slurm": runs are submitted with sbatch on this (login) host
    partition: str | None = None
    account: str | None = None
    sbatch_args_json: str | None = None
    slurm_gpus: str | None = None


class Run(SQLModel, table=True):
    """One launched (or launching) job and where the controller is in its journal."""

    __tablename__ = "runs"
    id: str = Field(primary_key=True)
    name: str
    host: str = Field(index=True)
    backend: str
    model: str | None = None
    spec_json: str
    state: str = Field(default="pending", index=True)
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    exit_json: str | None = None
    failure_reason: str | None = None
    pid: int | None = None
    last_seq: int = 0
    log_offset: int = 0
    progress_json: str | None = None
    last_milestone: str | None = None
    last_progress_at: float | None = None
    progress_interval_s: float | None = None
    #: When the agent last journaled a capture file's check (a run whose files are checked is not stalled).
    last_check_at: float | None = None
    #: The run this one resumes (same spec and output directory), if any.
    resumed_from: str | None = None
    #: The Slurm job id of a run submitted on a Slurm host (set from the launch reply).
    scheduler_job: str | None = None
    #: A sharded run (the one users see): its number of shards; its shards' jobs are runs of their own.
    shards: int | None = None
    #: A shard's job: the sharded run it belongs to (hidden from run lists) and its shard index.
    shard_of: str | None = Field(default=None, index=True)
    shard_index: int | None = None


class RunShard(SQLModel, table=True):
    """One shard of a sharded run: where it was placed and the job (a run row) of its latest attempt."""

    __tablename__ = "run_shards"
    run_id: str = Field(primary_key=True)
    idx: int = Field(primary_key=True)
    host: str
    gpus_json: str = "null"
    job_id: str = Field(index=True)
    attempts: int = 1
    #: A task of a Slurm array job (job_id runs the tasks of several shards): its task id (= the index),
    #: and what the job's journal said of this task alone (task_ended, its progress, its last milestone).
    task: int | None = None
    task_state: str | None = None
    task_reason: str | None = None
    task_progress_json: str | None = None
    task_milestone: str | None = None


class Event(SQLModel, table=True):
    """Every committed item the web streams (journal events with ``seq``, controller events without)."""

    __tablename__ = "events"
    __table_args__ = (UniqueConstraint("run_id", "seq", name="uq_events_run_seq"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str | None = Field(default=None, index=True)
    seq: int | None = None
    kind: str
    at: float
    data_json: str
    #: log_blocks.id of the last log block committed before this event (orders the merged feed).
    log_mark: int = 0


class Milestone(SQLModel, table=True):
    """A milestone from a run's journal."""

    __tablename__ = "milestones"
    __table_args__ = (UniqueConstraint("run_id", "seq", name="uq_milestones_run_seq"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    seq: int
    kind: str
    at: float
    line: int | None = None
    rank: int | None = None
    fields_json: str = "{}"
    text: str = ""


class Problem(SQLModel, table=True):
    """An output problem found by a shape check."""

    __tablename__ = "problems"
    __table_args__ = (UniqueConstraint("run_id", "seq", "idx", name="uq_problems_run_seq_idx"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    seq: int
    idx: int = 0
    code: str
    file: str
    message: str
    at: float


class Alert(SQLModel, table=True):
    """A raised alert; delivery goes through the outbox."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_key", "dedupe_key", "created_at"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str | None = None
    host: str | None = None
    rule: str
    severity: str
    message: str
    created_at: float
    dedupe_key: str
    acked: bool = False
    muted: bool = False
    delivered: bool = False


class Outbox(SQLModel, table=True):
    """A pending notification: retried with backoff until apprise accepts it; survives restarts."""

    __tablename__ = "outbox"
    id: int | None = Field(default=None, primary_key=True)
    alert_id: int = Field(index=True)
    attempts: int = 0
    next_attempt_at: float
    last_error: str | None = None
    done: bool = Field(default=False, index=True)


class LogBlock(SQLModel, table=True):
    """Consecutive lines of a job's output.log in one row (controller/logblocks.py): their texts joined by
    newlines, keyed by stream offsets, so a replayed block adds only the lines past ``runs.log_offset``."""

    __tablename__ = "log_blocks"
    __table_args__ = (UniqueConstraint("run_id", "offset", name="uq_log_blocks_run_offset"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str
    #: stream offset of the first line, and the offset after the last
    offset: int
    end_offset: int
    text: str
    #: each line's offset (little-endian int64), NULL when they are the natural ones
    offsets: bytes | None = None


def validation_errors(exc: ValidationError) -> list[dict[str, str]]:
    """pydantic errors as [{field, message}] naming each bad field."""
    out = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err.get("loc", ()))
        if not field:  # a model-level rule: name the first spec field its message mentions
            msg = str(err.get("msg", ""))
            named = [f for f in RunSpec.model_fields if f != "backend" and re.search(rf"\b{f}\b", msg)]
            field = named[0] if named else "spec"
        out.append({"field": field, "message": str(err.get("msg", "invalid"))})
    return out


def parse_run_spec(data: object) -> RunSpec:
    """A run spec as a user wrote it (CLI, spec file, the stored spec a run resumes) validated; SpecInvalid
    names each bad field."""
    if not isinstance(data, dict):
        raise SpecInvalid([{"field": "spec", "message": "a run spec must be a JSON object"}])
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecInvalid(validation_errors(exc)) from None


def parse_destination(dest: str) -> tuple[str, int | None, str | None]:
    """Split ``[ssh://][user@]host[:port]`` (IPv6 in brackets) into (host, port, user); ValueError names what
    is wrong.  An ``~/.ssh/config`` alias is just a host here: asyncssh applies the config to it."""
    rest = dest.removeprefix("ssh://")
    user, sep, hostport = rest.rpartition("@")
    if not sep:
        user, hostport = "", rest
    port: int | None = None
    if hostport.startswith("["):
        host, _, tail = hostport[1:].partition("]")
        if tail.startswith(":") and tail[1:].isdigit():
            port = int(tail[1:])
    else:
        host, colon, tail = hostport.partition(":")
        if colon:
            if not tail.isdigit() or not 0 < int(tail) < 65536:
                raise ValueError(f"bad port in ssh destination {dest!r}")
            port = int(tail)
    if not host:
        raise ValueError(f"no host in ssh destination {dest!r}")
    return host, port, user or None


# ---------------------------------------------------------------- public shapes (facade / API output)


class HostCreate(BaseModel):
    """Input for adding a host."""

    # Values are taken as written (sbatch_args are argv items); only the ssh destination is trimmed, as
    # whitespace can never be part of one.
    model_config = ConfigDict(extra="forbid")
    name: str = PField(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    ssh: Annotated[str, StringConstraints(strip_whitespace=True)] = PField(
        min_length=1, max_length=512, description="ssh destination: alias, host, user@host[:port]"
    )
    python: str = PField(default="python3", min_length=1, max_length=1024)
    state_dir: str | None = PField(default=None, description="agent state directory (default: agent's)")
    scheduler: Literal["slurm"] | None = PField(
        default=None, description="'slurm': a login node; each run is submitted as a Slurm job"
    )
    partition: str | None = PField(default=None, description="Slurm partition (sbatch --partition)")
    account: str | None = PField(default=None, description="Slurm account (sbatch --account)")
    sbatch_args: list[str] = PField(
        default_factory=list, max_length=64, description="extra sbatch options, one --name[=value] each"
    )
    slurm_gpus: Literal["gpus-per-task", "gres", "none"] = PField(
        default="gpus-per-task", description="how a run asks Slurm for its GPUs (none: CPU-only nodes)"
    )

    @field_validator("partition", "account")
    @classmethod
    def _slurm_name(cls, v: str | None) -> str | None:
        problem = slurm_name_problem("value", v or None)
        if problem:
            raise ValueError(problem)
        return v or None

    @field_validator("sbatch_args")
    @classmethod
    def _sbatch_args(cls, v: list[str]) -> list[str]:
        for arg in v:
            problem = sbatch_arg_problem(arg)
            if problem:
                raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _slurm_only(self) -> HostCreate:
        if self.scheduler is None:
            given = [f for f in ("partition", "account", "sbatch_args") if getattr(self, f)]
            if given:
                raise ValueError(f"{', '.join(given)} need scheduler 'slurm' (--scheduler slurm)")
        return self

    def to_row(self) -> dict[str, Any]:
        """The hosts table's columns for this host."""
        data = self.model_dump(exclude={"sbatch_args"})
        data["sbatch_args_json"] = json.dumps(self.sbatch_args) if self.scheduler else None
        data["slurm_gpus"] = self.slurm_gpus if self.scheduler else None
        return data

    @field_validator("ssh")
    @classmethod
    def _ssh(cls, v: str) -> str:
        if v.startswith("-") or any(c.isspace() or c == "\x00" for c in v):
            raise ValueError("ssh destination must not start with '-' or contain spaces")
        if v != "local":
            parse_destination(v)
        return v


class HostPublic(BaseModel):
    """A host as shown to users."""

    name: str
    ssh: str
    python: str
    reachable: bool | None
    last_seen: float | None
    agent_version: str | None
    fingerprint: str | None
    gpus: list[dict[str, Any]]
    last_error: str | None = None
    scheduler: str | None = None
    partition: str | None = None
    account: str | None = None
    sbatch_args: list[str] = []
    slurm_gpus: str | None = None
    #: The path this controller's latest link to the host took (controller/streamlocal.py ROUTE_*:
    #: ``direct-streamlocal``, ``connect-bridge`` or ``local-pipes``) and why not a shorter one; null before
    #: this process has linked to it.
    link_route: str | None = None
    link_route_reason: str | None = None


class AlertPublic(BaseModel):
    """An alert as shown to users."""

    id: int
    run_id: str | None
    host: str | None
    rule: str
    severity: str
    message: str
    created_at: float
    acked: bool
    muted: bool
    delivered: bool


class RunPublic(BaseModel):
    """A run as listed."""

    id: str
    name: str
    host: str
    backend: str
    model: str | None
    state: str
    created_at: float
    started_at: float | None
    ended_at: float | None
    exit: dict[str, Any] | None
    failure_reason: str | None
    progress: dict[str, Any] | None
    last_milestone: str | None
    open_alerts: int
    #: ``ok`` | ``problems`` (ended, but files failed checks or alerts fired) | ``failed``; null while running
    verdict: str | None = None
    #: the verdict in a sentence: ``completed — 24 of 24 files failed shape checks; no file is good``
    verdict_text: str | None = None
    #: the Slurm job id on a Slurm host (a ``pending`` run with one waits in Slurm's queue)
    scheduler_job: str | None = None


class MilestonePublic(BaseModel):
    """A milestone as shown to users."""

    #: The shard whose job reported it (sharded runs only).
    shard: int | None = None
    seq: int
    kind: str
    at: float
    line: int | None
    rank: int | None
    fields: dict[str, Any]
    text: str


class ProblemPublic(BaseModel):
    """An output problem as shown to users."""

    code: str
    file: str
    message: str
    at: float


class ShardPublic(BaseModel):
    """One shard of a sharded run, as shown in its shard table."""

    index: int
    host: str
    gpus: list[int] | None
    job_id: str
    attempts: int
    state: str
    progress: dict[str, Any] | None
    last_milestone: str | None
    failure_reason: str | None
    #: The Slurm array task id when the shard is one task of an array job (``job_id`` shared), else None.
    task: int | None = None


class RunDetail(RunPublic):
    """A run with its spec, milestones, alerts and problems (``GET /api/runs/{id}``)."""

    spec: dict[str, Any]
    resumed_from: str | None = None
    resumed_by: list[str] = []
    milestones: list[MilestonePublic]
    alerts: list[AlertPublic]
    problems: list[ProblemPublic]
    #: A sharded run's shards (absent from the JSON of an ordinary run).
    shards: list[ShardPublic] | None = None
