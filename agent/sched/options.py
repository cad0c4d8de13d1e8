"""A Slurm host's submission settings and their checks: pure, shared by the controller and the agent."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

GPU_REQUESTS = ("gpus-per-task", "gres", "none")
_OPTION_RE = re.compile(r"--([a-z][a-z0-9-]*)(?:=[^\n\0]*)?")
#: Options eaglewatch sets itself; a host's extra sbatch arguments may not override them.
_RESERVED = ("output", "error", "array", "parsable", "chdir", "wrap", "job-name", "open-mode")
#: Options after which sbatch submits nothing, or blocks until the job ends, instead of printing its id.
_NO_JOB_ID = ("wait", "test-only", "help", "usage", "version")
_NAME_RE = re.compile(r"[A-Za-z0-9_.,:-]{1,128}")
#: sbatch's long options (Slurm 22.05, as its getopt_long knows them: `sbatch --a=1` lists those of 'a').
#: sbatch accepts any unambiguous prefix of one, so an abbreviation must be resolved before it is judged.
_SBATCH_LONG = """
    account acctg-freq array batch bb bbf begin chdir cluster cluster-constraint clusters comment constraint
    container context contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline
    delay-boot dependency distribution error exclude exclusive export export-file extra-node-info
    get-user-env gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags help
    hint hold ignore-pbs input job-name kill-on-invalid-dep licenses mail-type mail-user mcs-label mem
    mem-bind mem-per-cpu mem-per-gpu mincpus network nice no-kill no-requeue nodefile nodelist nodes ntasks
    ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket ntasks-per-tres open-mode output
    overcommit oversubscribe parsable partition power prefer priority profile propagate qos quiet reboot
    requeue reservation signal sockets-per-node spread-job switches tasks-per-node test-only thread-spec
    threads-per-core time time-min tmp uid usage use-min-nodes verbose version wait wait-all-nodes wckey
    wrap
"""
SBATCH_LONG_OPTIONS = tuple(_SBATCH_LONG.split())


def slurm_name_problem(field_name: str, value: Any) -> str | None:
    """Why ``value`` cannot be a partition or account name, else None."""
    if value is None or (isinstance(value, str) and _NAME_RE.fullmatch(value)):
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
        if unknown := set(raw) - {"kind", "partition", "account", "sbatch_args", "gpus", "shards", "tasks"}:
            raise ValueError(f"scheduler: unknown field(s) {', '.join(sorted(unknown))}")
        for name in ("partition", "account"):
            if problem := slurm_name_problem(f"scheduler.{name}", raw.get(name)):
                raise ValueError(problem)
        args = raw.get("sbatch_args") or []
        if not isinstance(args, list) or len(args) > 64:
            raise ValueError("scheduler.sbatch_args must be a list of at most 64 options")
        for arg in args:
            if problem := sbatch_arg_problem(arg):
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


def resolve_long(name: str) -> tuple[str, ...]:
    """The sbatch long options ``--name`` stands for, as getopt_long decides: itself, else all it prefixes."""
    if name in SBATCH_LONG_OPTIONS:
        return (name,)
    return tuple(o for o in SBATCH_LONG_OPTIONS if o.startswith(name))


def sbatch_arg_problem(arg: Any) -> str | None:
    """Why ``arg`` cannot be an extra sbatch option (one ``--name[=value]`` each), else None."""
    m = _OPTION_RE.fullmatch(arg) if isinstance(arg, str) and len(arg) <= 1024 else None
    if m is None:
        return f"{str(arg)[:80]!r} is not one long option --name or --name=value"
    name = m.group(1)
    means = resolve_long(name)
    if len(means) > 1:
        return f"--{name} is ambiguous: sbatch cannot tell {', '.join('--' + o for o in means)} apart"
    # An option unknown here (a newer Slurm's) passes: that sbatch resolves it, and it cannot mean a
    # reserved option, every prefix of which is known here.
    target = means[0] if means else name
    if target in _RESERVED:
        why = "is set by eaglewatch itself"
    elif target in _NO_JOB_ID:
        why = "would keep sbatch from submitting the job and printing its id at once"
    else:
        return None
    return f"--{name} {why}" if target == name else f"--{name} abbreviates --{target}, which {why}"
