"""Pure: a sharded run's placement over hosts and GPU groups, its jobs' specs, and its one state and progress
(the decisions of shardruns.py and shard_store.py, kept apart from I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.spec import RunSpec, Shard
from controller.lifecycle import RunState, is_terminal

S = RunState
#: While shards run, the run shows the state of its least advanced shard that still matters.
_ACTIVE_ORDER = (S.RUNNING, S.UNKNOWN, S.STARTING, S.PENDING)


class PlacementError(ValueError):
    """The shards do not fit on the hosts' GPUs; the message names the host."""


@dataclass(frozen=True)
class Placement:
    """Where one shard runs: its host and, on a GPU host, the GPU indices it may see."""

    index: int
    host: str
    gpus: tuple[int, ...] | None  # None: a CPU host or GPUs unknown (nothing is set)
    #: On a CPU host given core groups: this shard's VLLM_CPU_OMP_THREADS_BIND (one group per TP rank).
    cpus: str | None = None


#: The env variable vLLM-CPU binds its workers' OpenMP threads by: core lists, one per rank, split by "|".
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_groups(env: dict[str, str]) -> list[str]:
    """Core groups shards may take on a CPU host: the spec's VLLM_CPU_OMP_THREADS_BIND split at "|" (e.g.
    "0-15|16-31|32-47|48-63": four TP=1 shards, or two TP=2); empty when not given or "auto"/"nobind"."""
    given = env.get(CPU_BIND, "").strip()
    if given in ("", "auto", "nobind"):
        return []
    return [g.strip() for g in given.split("|") if g.strip()]


def gpu_indices(gpus: list[dict[str, Any]], env: dict[str, str]) -> list[int]:
    """The GPU indices shards may use on a host: the spec's CUDA_VISIBLE_DEVICES if it lists indices, else
    the host's discovered GPUs (empty when none are known)."""
    given = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if given:
        parts = [p.strip() for p in given.split(",")]
        if all(p.isdigit() for p in parts):
            return [int(p) for p in parts]
    return sorted(int(g["index"]) for g in gpus if isinstance(g.get("index"), int))


def place(
    count: int, hosts: list[tuple[str, list[int]]], tp: int, cpus: list[str] | None = None
) -> list[Placement]:
    """Shard i on hosts[i % H] (round-robin); on a host with GPUs its k-th shard gets GPU group k of tp GPUs.

    hosts: (name, GPU indices) in the order given; an empty list means a CPU host or unknown GPUs, whose
    k-th shard gets tp of the core groups ``cpus`` (cpu_groups) when given, else nothing is set.
    PlacementError when a host gets more shards than it has disjoint GPU (or core) groups: two engines on
    one GPU would fight over its memory, on the same cores over the CPU.
    """
    if not hosts:
        raise PlacementError("a sharded run needs at least one host")
    out = []
    for i in range(count):
        name, gpus = hosts[i % len(hosts)]
        k = i // len(hosts)
        if not gpus and cpus:
            if (k + 1) * tp > len(cpus):
                per_host = len(range(i % len(hosts), count, len(hosts)))
                raise PlacementError(
                    f"host {name} has no GPUs and {len(cpus)} core groups in {CPU_BIND} "
                    f"({len(cpus) // tp} of tensor_parallel_size {tp}) but {per_host} shards are placed on it"
                )
            out.append(Placement(i, name, None, "|".join(cpus[k * tp : (k + 1) * tp])))
            continue
        if not gpus:
            out.append(Placement(i, name, None))
            continue
        groups = len(gpus) // tp
        if k >= groups:
            per_host = len(range(i % len(hosts), count, len(hosts)))
            raise PlacementError(
                f"host {name} has {len(gpus)} GPUs ({groups} groups of tensor_parallel_size {tp}) "
                f"but {per_host} shards are placed on it"
            )
        out.append(Placement(i, name, tuple(gpus[k * tp : (k + 1) * tp])))
    return out


def shard_spec(spec: RunSpec, at: Placement, count: int) -> RunSpec:
    """The job spec of one shard: one host, its shard, its GPUs in CUDA_VISIBLE_DEVICES (or its cores in
    VLLM_CPU_OMP_THREADS_BIND); not split again."""
    env = dict(spec.env)
    if at.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, at.gpus))
    if at.cpus is not None:
        env[CPU_BIND] = at.cpus
    shard = Shard(index=at.index, count=count)
    return spec.model_copy(update={"host": at.host, "shard": shard, "env": env, "shards": 1})


def array_spec(spec: RunSpec, host: str) -> RunSpec:
    """The spec of one Slurm host's array job: the run's, on that host, not split again here (each task
    gets its ``shard`` from its task id on the cluster, agent/sched/task.py)."""
    return spec.model_copy(update={"host": host, "shards": 1})


def job_document(spec: RunSpec) -> dict[str, Any]:
    """A job's spec as its run row stores it and its agent gets it: without ``shards``, which is its
    sharded run's business, not the job's."""
    return spec.model_dump(mode="json", exclude={"shards"})


def run_state(shard_states: list[str]) -> str:
    """The one state of a sharded run: active while any shard is; then failed, lost, stopped or completed.

    A failed shard fails the run only once the others have ended (they go on meanwhile).
    """
    if not shard_states:
        return S.PENDING.value
    states = [RunState(s) for s in shard_states]
    active = [s for s in states if not is_terminal(s)]
    if active:
        return next(s for s in _ACTIVE_ORDER if s in active).value
    for outcome in (S.FAILED, S.LOST, S.STOPPED):
        if outcome in states:
            return outcome.value
    return S.COMPLETED.value


def task_state(job_state: str, ended_as: str | None) -> str:
    """The state of a shard run as one task of an array job: how its task ended (``task_ended``: completed,
    failed or stopped) once it has, else its job's state (pending, running, … or, for a job that ended with
    no word on this task, the job's end: stopped, lost)."""
    if ended_as in (S.COMPLETED.value, S.FAILED.value, S.STOPPED.value):
        return ended_as
    return job_state


def run_progress(shard_progress: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Sum of the shards' last progress: samples done and total, tokens/s, files and bytes written; the ETA
    is the slowest shard's (they run side by side)."""
    seen = [p for p in shard_progress if p]
    if not seen:
        return None
    keys = ("samples_done", "samples_total", "files_written", "bytes_written")
    out: dict[str, Any] = {k: sum(int(p.get(k) or 0) for p in seen) for k in keys}
    out["tokens_per_s"] = round(sum(float(p.get("tokens_per_s") or 0.0) for p in seen), 1)
    out["shards_reporting"] = len(seen)
    etas = [float(p["eta_s"]) for p in seen if isinstance(p.get("eta_s"), (int, float))]
    if etas:
        out["eta_s"] = max(etas)
    return out
