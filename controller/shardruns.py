"""Sharded runs: one dataset over many GPU groups and hosts, seen as one run (fan out, resume, stop, card).

Each shard is an ordinary agent job (a hidden run row) with its own spec: ``shard`` and, on a GPU host,
``CUDA_VISIBLE_DEVICES`` naming its GPU group.  ``shard_jobs`` is the one place a run becomes per-host jobs.
The shards placed on a Slurm host are instead one array job there (``slurm_arrays``): one hidden job row,
one sbatch, its task i being shard i; each shard row names that job and its task.  A job's spec stays a
``RunSpec`` until ``job_document`` writes it for the database and the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.spec import RunSpec
from controller import crud, queries, shard_store
from controller.errors import Conflict, NotFound, SpecInvalid
from controller.lifecycle import RESUMABLE_STATES, RunEvent, is_terminal
from controller.models import ShardPublic, parse_run_spec
from controller.runs import new_run_id
from controller.sharding import (
    Placement,
    PlacementError,
    array_spec,
    cpu_groups,
    gpu_indices,
    job_document,
    place,
    shard_spec,
)
from controller.store import Tx

if TYPE_CHECKING:
    from controller.service import Controller


@dataclass(frozen=True)
class ShardJob:
    """One shard's job: where it runs and the spec its host's agent gets."""

    index: int
    host: str
    gpus: tuple[int, ...] | None
    spec: RunSpec


def shard_jobs(parsed: RunSpec, hosts: dict[str, dict[str, Any]]) -> list[ShardJob]:
    """The jobs of a sharded run: its shards placed round-robin over its hosts' GPU groups; PlacementError
    when the shards do not fit the hosts' GPUs."""
    groups = [  # a Slurm login node's own GPUs are not its compute nodes': Slurm hands those out
        (
            name,
            []
            if is_slurm(hosts[name])
            else gpu_indices(json.loads(hosts[name].get("gpus_json") or "[]"), parsed.env),
        )
        for name in parsed.hosts
    ]
    return [
        ShardJob(p.index, p.host, p.gpus, shard_spec(parsed, p, parsed.shards))
        for p in place(parsed.shards, groups, parsed.tensor_parallel_size, cpu_groups(parsed.env))
    ]


def is_slurm(host: dict[str, Any]) -> bool:
    """Whether runs on this host are Slurm jobs (its shards are then one array job)."""
    return host.get("scheduler") == "slurm"


def slurm_arrays(jobs: list[ShardJob], hosts: dict[str, dict[str, Any]]) -> dict[str, list[ShardJob]]:
    """The shards each Slurm host gets, in host order (one array job each); the other hosts' are left out."""
    out: dict[str, list[ShardJob]] = {}
    for job in jobs:
        if is_slurm(hosts.get(job.host) or {}):
            out.setdefault(job.host, []).append(job)
    return out


class ShardOps:
    """The Controller's run operations for a sharded run: create its jobs, resume a shard, stop, its card."""

    def __init__(self, jobs: Controller) -> None:
        self.jobs = jobs
        self.store = jobs.store
        self.supervisors = jobs.supervisors
        self.policy = jobs.policy

    async def create(self, parsed: RunSpec) -> str:
        """Place the shards, write the run and its jobs, launch every job; returns the run's id."""
        hosts = {name: await self.store.read(queries.host_row, name) for name in parsed.hosts}
        try:
            jobs = shard_jobs(parsed, hosts)
        except PlacementError as exc:
            raise SpecInvalid([{"field": "shards", "message": str(exc)}]) from None
        return await self._start(parsed, jobs, [], None, {}, arrays=slurm_arrays(jobs, hosts))

    async def _start(
        self,
        parsed: RunSpec,
        jobs: list[ShardJob],
        keep: list[ShardPublic],
        resumed_from: str | None,
        previous: dict[int, str],
        attempts: dict[int, int] | None = None,
        arrays: dict[str, list[ShardJob]] | None = None,
    ) -> str:
        attempts = attempts or {}
        arrays = arrays or {}
        run_id = new_run_id()
        document = parsed.model_dump(mode="json")
        in_array = {j.index for tasks in arrays.values() for j in tasks}
        launch = [(f"{run_id}-s{j.index}", j) for j in jobs if j.index not in in_array]
        array_jobs = [(f"{run_id}-array{k}", host, tasks) for k, (host, tasks) in enumerate(arrays.items())]

        def insert(tx: Tx) -> None:
            crud.ensure_output_dir_free(tx=tx, hosts=parsed.hosts, output_dir=parsed.output_dir)
            crud.insert_run(
                tx=tx, run_id=run_id, name=parsed.name, host=",".join(parsed.hosts), backend=parsed.backend,
                model=parsed.model, spec_json=json.dumps(document), resumed_from=resumed_from,
                shards=parsed.shards,
            )  # fmt: skip
            for s in keep:  # completed shards of the run this one resumes: their jobs count here too
                shard_store.carry_shard(tx.conn, resumed_from or "", run_id, s.index)
            for job_id, host, tasks in array_jobs:
                crud.insert_run(
                    tx=tx, run_id=job_id, name=f"{parsed.name} shards {','.join(str(j.index) for j in tasks)}"
                    f"/{parsed.shards} (Slurm array)", host=host, backend=parsed.backend, model=parsed.model,
                    spec_json=json.dumps(job_document(array_spec(parsed, host))), resumed_from=None,
                    shard_of=run_id,
                )  # fmt: skip
                for j in tasks:
                    shard_store.insert_shard(tx.conn, run_id, j.index, host, None, job_id, 1, task=j.index)
                crud.transition(tx=tx, run_id=job_id, event=RunEvent.LAUNCH, policy=self.policy)
            for job_id, job in launch:
                self._insert_job(tx, run_id, job_id, job, parsed.shards, previous.get(job.index))
                shard_store.insert_shard(
                    tx.conn, run_id, job.index, job.host, job.gpus, job_id, attempts.get(job.index, 0) + 1
                )
                crud.transition(tx=tx, run_id=job_id, event=RunEvent.LAUNCH, policy=self.policy)
            if shard_store.aggregate(tx.conn, run_id, tx.now, None):
                crud.publish_run(tx=tx, run_id=run_id)

        await self.store.write(insert)
        # A new run's refused host path is the caller's spec error, as for an unsharded run: the whole run
        # is forgotten (a resumed one keeps its history: the refused shard fails instead).
        fresh = resumed_from is None
        results = await asyncio.gather(
            *(
                self.jobs.launch(job_id, job.host, job_document(job.spec), discard_refused=fresh)
                for job_id, job in launch
            ),
            *(
                self.jobs.launch(
                    job_id,
                    host,
                    job_document(array_spec(parsed, host)),
                    array=(parsed.shards, [j.index for j in tasks]),
                    discard_refused=fresh,
                )
                for job_id, host, tasks in array_jobs
            ),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        refused = [r for r in errors if isinstance(r, SpecInvalid)]
        if refused:
            # forget the refused new run: stop the jobs that did launch, drop the run, its shards and jobs
            job_ids = [job_id for job_id, _ in launch] + [j for j, _, _ in array_jobs]
            for job_id in job_ids:
                with contextlib.suppress(Exception):  # refused, finished or unreachable: forgotten either way
                    await self.jobs.stop_job(job_id)

            def forget(tx: Tx) -> None:
                tx.conn.execute("DELETE FROM run_shards WHERE run_id=?", (run_id,))
                for rid in [*job_ids, run_id]:
                    crud.discard_run(tx=tx, run_id=rid)

            await self.store.write(forget)
            raise refused[0]
        if errors:
            raise errors[0]
        return run_id

    def _insert_job(
        self, tx: Tx, run_id: str, job_id: str, job: ShardJob, count: int, resumed_from: str | None
    ) -> None:
        crud.insert_run(
            tx=tx, run_id=job_id, name=f"{job.spec.name} shard {job.index}/{count}", host=job.host,
            backend=job.spec.backend, model=job.spec.model, spec_json=json.dumps(job_document(job.spec)),
            resumed_from=resumed_from, shard_of=run_id, shard_index=job.index,
        )  # fmt: skip

    async def resume(self, run: dict[str, Any], shard: int | None) -> str:
        """Start new attempts of the failed, stopped or lost shards (or only ``shard``); the others go on.

        While the run is active it stays the same run; once it has ended a new run carries its completed
        shards over (a terminal state never moves back).  Returns the id of the run to follow.
        """
        run_id = run["id"]
        rows = await self.store.read(shard_store.shards, run_id)
        if shard is not None and not 0 <= shard < len(rows):
            raise NotFound(f"run {run_id} has no shard {shard} (its shards are 0 to {len(rows) - 1})")
        targets = [rows[shard]] if shard is not None else [r for r in rows if r.state in RESUMABLE_STATES]
        for r in targets:
            if r.state not in RESUMABLE_STATES:
                raise Conflict(
                    f"shard {r.index} of run {run_id} is {r.state}: "
                    "only a failed, stopped or lost shard can be resumed"
                )
        if not targets:
            raise Conflict(f"no shard of run {run_id} failed, stopped or was lost: nothing to resume")
        jobs = []
        for r in targets:
            old = await self.store.read(queries.run_row, r.job_id)
            spec = parse_run_spec(json.loads(old["spec_json"]))
            if r.task is not None:  # a task of an array job: now a job of its own, one sbatch of its shard
                spec = shard_spec(spec, Placement(r.index, r.host, None), len(rows))
            jobs.append(ShardJob(r.index, r.host, tuple(r.gpus) if r.gpus else None, spec))
        previous = {r.index: r.job_id for r in targets}
        attempts = {r.index: r.attempts for r in targets}
        if is_terminal(run["state"]):
            parsed = parse_run_spec(json.loads(run["spec_json"]))
            keep = [r for r in rows if r.index not in previous]
            return await self._start(parsed, jobs, keep, run_id, previous, attempts)
        launch = [(f"{run_id}-s{j.index}-a{attempts[j.index] + 1}", j) for j in jobs]

        def insert(tx: Tx) -> None:
            now = tx.conn.execute("SELECT state FROM runs WHERE id=?", (run_id,)).fetchone()[0]
            if is_terminal(now):  # its other shards ended since it was read: it cannot take new jobs now
                raise Conflict(f"run {run_id} has just ended ({now}): resume it again to start a new run")
            current = {s.index: s.job_id for s in shard_store.shards(tx.conn, run_id)}
            for job in jobs:  # a shard is resumed once: a resume that raced this one has replaced its job
                if current.get(job.index) != previous[job.index]:
                    raise Conflict(
                        f"shard {job.index} of run {run_id} was already resumed as job "
                        f"{current.get(job.index)}: resume it again once that one has ended"
                    )
            for job_id, job in launch:
                self._insert_job(tx, run_id, job_id, job, run["shards"], previous[job.index])
                shard_store.replace_job(tx.conn, run_id, job.index, job_id)
                crud.transition(tx=tx, run_id=job_id, event=RunEvent.LAUNCH, policy=self.policy)

        await self.store.write(insert)
        await asyncio.gather(
            *(self.jobs.launch(job_id, j.host, job_document(j.spec)) for job_id, j in launch)
        )
        return run_id

    async def stop(self, run: dict[str, Any]) -> dict[str, Any]:
        """Stop every shard's job that is still going; the run ends once they all have."""
        rows = await self.store.read(shard_store.shards, run["id"])
        # pending too: a shard's Slurm job (or array) waiting in the queue is scancelled there
        going = [r for r in rows if not is_terminal(r.state)]
        # An array job's tasks share it: one stop (one scancel) for all of them.
        job_ids = list(dict.fromkeys(r.job_id for r in going))
        results = await asyncio.gather(*(self.jobs.stop_job(j) for j in job_ids), return_exceptions=True)
        failed = [(j, e) for j, e in zip(job_ids, results, strict=True) if isinstance(e, BaseException)]
        if failed and len(failed) == len(job_ids):
            raise failed[0][1]
        stopped = {j for j, e in zip(job_ids, results, strict=True) if not isinstance(e, BaseException)}
        return {"stopped": [r.index for r in going if r.job_id in stopped]}

    async def card(self, run: dict[str, Any]) -> dict[str, Any]:
        """The merged manifest.json (all shards, totals) from the first host whose output dir has it."""
        rows = await self.store.read(shard_store.shards, run["id"])
        seen: set[str] = set()
        last = "no shard has written a manifest yet"
        for r in rows:
            if r.host in seen:
                continue
            seen.add(r.host)
            try:
                async with self.supervisors.link_for(r.host) as link:
                    doc = await link.request("manifest", run=r.job_id, timeout=60)
            except Exception as exc:  # any host's failure is only a reason to try the next
                last = f"host {r.host}: {exc}"
                continue
            if isinstance(doc, dict) and doc.get("shards") and not doc.get("shard"):
                return doc
            last = f"host {r.host} has no merged manifest.json yet"
        raise Conflict(
            f"run {run['id']}: no merged manifest yet ({last}); it is written when the last shard completes "
            "(shards on several hosts: gather their files and run eaglewatch-agent merge-manifests DIR)"
        )
