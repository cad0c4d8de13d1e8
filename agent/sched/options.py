"""A Slurm host's submission settings and their checks: pure, shared by the controller and the agent."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

GPU_REQUESTS = ("gpus-per-task", "gres", "none")
_OPTION_RE = re.compile(r"^--[a-z][a-z0-9-]*(=.*)?$", re.S)
#: Options eaglewatch sets itself; a host's extra sbatch arguments may not override them.
_RESERVED = ("--output", "--error", "--array", "--parsable", "--chdir", "--wrap", "--job-name", "--open-mode")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.,:-]{1,128}$")


def slurm_name_problem(field_name: str, value: Any) -> str | None:
    """Why ``value`` cannot be a partition or account name, else None."""
    if value is None or (isinstance(value, str) and _NAME_RE.match(value)):
        return None
    return f"{field_name} must be a Slurm name (letters, digits, '_.,:-'), got {str(value)[:80]!r}"


@dataclass(frozen=True)
class SlurmOptions:
    """A host's submission settings, as the controller sends them with a launch (``scheduler``)."""

    partition: str | None = None
    account: str | None = None
    sbatch_args: list[str] = field(default_factory=list)
    gpus: str = "gpus-per-task"
    shards: int | None = None  # submit as one array job of this many tasks (spec shard index = task id)
    #: Only these task ids (shard indices) of the ``shards``, e.g. a cluster's share of a sharded run.
    tasks: list[int] | None = None

    @classmethod
    def parse(cls, raw: Any) -> SlurmOptions:
        """The options of a launch's ``scheduler`` object; ValueError naming the bad field."""
        if not isinstance(raw, dict) or raw.get("kind") != "slurm":
            raise ValueError("'scheduler' must be an object with kind 'slurm'")
        unknown = set(raw) - {"kind", "partition", "account", "sbatch_args", "gpus", "shards", "tasks"}
        if unknown:
            raise ValueError(f"scheduler: unknown field(s) {', '.join(sorted(unknown))}")
        for name in ("partition", "account"):
            problem = slurm_name_problem(f"scheduler.{name}", raw.get(name))
            if problem:
                raise ValueError(problem)
        args = raw.get("sbatch_args") or []
        if not isinstance(args, list) or len(args) > 64:
            raise ValueError("scheduler.sbatch_args must be a list of at most 64 options")
        for arg in args:
            problem = sbatch_arg_problem(arg)
            if problem:
                raise ValueError(f"scheduler.sbatch_args: {problem}")
        gpus = raw.get("gpus", "gpus-per-task")
        if gpus not in GPU_REQUESTS:
            raise ValueError(f"scheduler.gpus must be one of {', '.join(GPU_REQUESTS)}, got {gpus!r}")
        shards = raw.get("shards")
        if shards is not None and (type(shards) is not int or not 1 <= shards <= 4096):
            raise ValueError("scheduler.shards must be an integer in [1, 4096]")
        tasks = raw.get("tasks")
        if tasks is not None and (
            shards is None
            or not isinstance(tasks, list)
            or not tasks
            or any(type(t) is not int or not 0 <= t < shards for t in tasks)
            or len(set(tasks)) != len(tasks)
        ):
            raise ValueError("scheduler.tasks must be distinct task ids in [0, scheduler.shards)")
        return cls(raw.get("partition"), raw.get("account"), list(args), gpus, shards, tasks)

    def task_ids(self) -> list[int] | None:
        """The array's task ids (every shard unless ``tasks`` picks some); None for a plain job."""
        if not self.shards:
            return None
        return sorted(self.tasks) if self.tasks else list(range(self.shards))


def sbatch_arg_problem(arg: Any) -> str | None:
    """Why ``arg`` cannot be an extra sbatch option (one ``--name[=value]`` each), else None."""
    if not isinstance(arg, str) or not _OPTION_RE.match(arg) or "\0" in arg or "\n" in arg or len(arg) > 1024:
        return f"{str(arg)[:80]!r} is not one long option --name or --name=value"
    if arg.split("=", 1)[0] in _RESERVED:
        return f"{arg.split('=', 1)[0]} is set by eaglewatch itself"
    return None
