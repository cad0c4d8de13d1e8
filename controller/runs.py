"""Run operations: check a validated spec against its hosts, write the run (pending) first, launch and stop
through the agent."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from agent.backends import PIPELINES
from agent.spec import RunSpec
from controller import crud, queries
from controller.alerts import AlertPolicy
from controller.errors import AgentError, Conflict, NotFound, SpecInvalid, Unreachable
from controller.fleet import Supervisors
from controller.lifecycle import RESUMABLE_STATES, RunEvent, event_for_agent_state, is_terminal
from controller.models import parse_run_spec
from controller.settings import Settings
from controller.shardruns import ShardOps
from controller.store import Store, Tx

#: The agent gives a forecast up to 300 s (agent/runs/output_info.py); the link waits a little longer.
FORECAST_TIMEOUT_S = 330


def new_run_id(now: float | None = None) -> str:
    """A sortable, unique run id: r-YYYYMMDD-HHMMSS-xxxx (UTC)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now or time.time()))
    return f"r-{stamp}-{secrets.token_hex(2)}"


def check_hosts(spec: RunSpec, hosts: dict[str, dict[str, Any] | None]) -> None:
    """What the spec model cannot know: that its hosts (name → row, None when there is no such host) exist
    and have the GPUs it asks for, and that its layer ids agree with ``expect.layers``; raises SpecInvalid."""
    errors = [
        {"field": "host", "message": f"no host named {name!r} (add it with: hosts add)"}
        for name, row in hosts.items()
        if row is None
    ]
    for row in (r for r in hosts.values() if r is not None):
        gpus = json.loads(row.get("gpus_json") or "[]")
        # A Slurm login node's own GPUs say nothing of the compute nodes' (Slurm refuses what none has).
        if gpus and row.get("scheduler") != "slurm" and spec.tensor_parallel_size > len(gpus):
            errors.append(
                {
                    "field": "tensor_parallel_size",
                    "message": f"{spec.tensor_parallel_size} > {len(gpus)} GPUs on host {row['name']}",
                }
            )
    if spec.layers is not None and spec.expect.layers is not None and len(spec.layers) != spec.expect.layers:
        errors.append(
            {
                "field": "layers",
                "message": f"{len(spec.layers)} layer ids but expect.layers is {spec.expect.layers}",
            }
        )
    if errors:
        raise SpecInvalid(errors)


#: Spec fields naming host paths (and an attach's job) the agent checks before a launch
#: (agent/daemon/launch_paths.py).
PATH_FIELDS = (
    "model", "dataset", "output_dir", "specforge.scripts_dir", "speculators.scripts_dir",
    "attach.pid", "attach.log", "attach.slurm_job",
)  # fmt: skip


def path_refusal(exc: AgentError | Unreachable) -> dict[str, str] | None:
    """The agent's refusal of a spec's host path as a field error, None for any other failure."""
    if not isinstance(exc, AgentError) or exc.agent_code != "bad_args":
        return None
    message = exc.message.removeprefix(f"agent: {exc.agent_code}: ").removeprefix("spec.")
    for field in PATH_FIELDS:
        if message.startswith(f"{field}: "):
            return {"field": field, "message": message.removeprefix(f"{field}: ")}
        if message.startswith(f"{field} "):
            return {"field": field, "message": message}
    return None


def scheduler_args(host: dict[str, Any]) -> dict[str, Any] | None:
    """The launch's ``scheduler`` object for a Slurm host (agent/sched/options.py), None for a plain one."""
    if host.get("scheduler") != "slurm":
        return None
    return {
        "kind": "slurm",
        "partition": host.get("partition"),
        "account": host.get("account"),
        "sbatch_args": json.loads(host.get("sbatch_args_json") or "[]"),
        "gpus": host.get("slurm_gpus") or "gpus-per-task",
    }


class RunOps:
    """Create and stop runs; launches go through the supervised link or a one-shot link."""

    new_id = staticmethod(new_run_id)

    def __init__(
        self, settings: Settings, store: Store, supervisors: Supervisors, policy: AlertPolicy
    ) -> None:
        self.settings = settings
        self.store = store
        self.supervisors = supervisors
        self.policy = policy
        self.sharded = ShardOps(store, supervisors, policy, self)

    async def _check_hosts(self, spec: RunSpec) -> None:
        """check_hosts against the spec's hosts as stored; raises SpecInvalid."""
        hosts: dict[str, dict[str, Any] | None] = {}
        for name in spec.hosts:
            try:
                hosts[name] = await self.store.read(queries.host_row, name)
            except NotFound:
                hosts[name] = None
        check_hosts(spec, hosts)

    async def create(self, spec: RunSpec, resumed_from: str | None = None) -> str:
        """Check the hosts, write pending, launch; a failed launch leaves a failed run with the reason.

        A spec with ``shards`` > 1 becomes one sharded run of several jobs (controller/shardruns.py)."""
        await self._check_hosts(spec)
        if spec.shards > 1:
            return await self.sharded.create(spec)
        run_id = new_run_id()
        document = spec.model_dump(mode="json")

        def insert(tx: Tx) -> None:
            crud.ensure_output_dir_free(tx=tx, hosts=spec.hosts, output_dir=spec.output_dir)
            crud.insert_run(
                tx=tx, run_id=run_id, name=spec.name, host=spec.hosts[0], backend=spec.backend,
                model=spec.model, spec_json=json.dumps(document), resumed_from=resumed_from,
            )  # fmt: skip
            crud.transition(tx=tx, run_id=run_id, event=RunEvent.LAUNCH, policy=self.policy)

        await self.store.write(insert)
        await self.launch(run_id, spec.hosts[0], document, discard_refused=True)
        return run_id

    async def launch(
        self,
        run_id: str,
        host: str,
        document: dict[str, Any],
        array: tuple[int, list[int]] | None = None,
        discard_refused: bool = False,
    ) -> None:
        """Ask ``host``'s agent to launch a written (starting) run with its spec as stored (``document``); a
        refusal fails it with the reason.

        ``array`` (shards, task ids): on a Slurm host, one array job running those shards of the run.
        ``discard_refused``: a host path the agent refuses (no such model, dataset or scripts; an output_dir
        not writable, in use or holding a capture) is the caller's spec error: the run is forgotten and
        SpecInvalid names the field."""
        try:
            row = await self.store.read(queries.host_row, host)
        except NotFound:
            row = {}
        extra = {"scheduler": sched} if (sched := scheduler_args(row)) else {}
        if sched is not None and array is not None:
            sched.update(shards=array[0], tasks=array[1])
        try:
            async with self.supervisors.link_for(host) as link:
                result = await link.request("launch", run=run_id, spec=document, timeout=120, **extra)
        except (AgentError, Unreachable) as exc:
            refusal = path_refusal(exc)
            if discard_refused and refusal is not None:
                await self.store.write(lambda tx: crud.discard_run(tx=tx, run_id=run_id))
                raise SpecInvalid([refusal]) from None
            reason = f"launch failed: {exc.message}"
            await self.store.write(
                lambda tx: crud.transition(
                    tx=tx, run_id=run_id, event=RunEvent.LAUNCH_FAILED, policy=self.policy, reason=reason
                )
            )
            return

        def launched(tx: Tx) -> None:
            job = result.get("job_id") if result.get("scheduler") == "slurm" else None
            crud.set_pid(tx=tx, run_id=run_id, pid=result.get("pid"), scheduler_job=job)
            # A Slurm job waits in the queue first: pending (with its job id) until the agent says running.
            event = RunEvent.LAUNCHED if job is None else RunEvent.JOB_PENDING
            crud.transition(tx=tx, run_id=run_id, event=event, policy=self.policy)

        await self.store.write(launched)
        self.supervisors.poke(host)

    async def resume(self, run_id: str, shard: int | None = None) -> str:
        """A new run with the same spec, linked to ``run_id``: the job keeps the files already written and
        captures only the missing or invalid ones.  Conflict unless an extraction that did not finish.

        A sharded run resumes its failed shards, or only ``shard`` (controller/shardruns.py)."""
        run = await self.store.read(queries.run_row, run_id)
        if run["shards"]:
            return await self.sharded.resume(run, shard)
        if shard is not None:
            raise Conflict(f"run {run_id} is not sharded: resume it without a shard")
        if run["state"] not in RESUMABLE_STATES:
            raise Conflict(
                f"run {run_id} is {run['state']}: only a failed, stopped or lost extraction can be resumed"
            )
        if run["backend"] == "command":
            raise Conflict(
                f"run {run_id} runs a command, which may not skip finished work: start it again instead"
            )
        spec = {**json.loads(run["spec_json"]), "resume": True}
        return await self.create(parse_run_spec(spec), resumed_from=run_id)

    async def forecast(self, spec: RunSpec) -> dict[str, Any]:
        """The host's forecast for a spec (bytes to write, free bytes, fits, estimated); launches nothing.

        A spec the job cannot forecast (no such model or dataset on the host) is SpecInvalid on `spec`.
        """
        await self._check_hosts(spec)
        if spec.backend == "command":
            raise SpecInvalid([{"field": "backend", "message": "a watched command has no forecast"}])
        try:
            async with self.supervisors.link_for(spec.hosts[0]) as link:
                document = spec.model_dump(mode="json")
                return await link.request("forecast", spec=document, timeout=FORECAST_TIMEOUT_S)
        except AgentError as exc:
            if (refusal := path_refusal(exc)) is not None:
                raise SpecInvalid([refusal]) from None
            if exc.agent_code in ("failed", "bad_args"):
                message = exc.message.removeprefix(f"agent: {exc.agent_code}: ")
                raise SpecInvalid([{"field": "spec", "message": f"no forecast: {message}"}]) from None
            raise

    async def card(self, run_id: str) -> dict[str, Any]:
        """The run's dataset card: its manifest.json as the host has it now (without the per-sample map)."""
        run = await self.store.read(queries.run_row, run_id)
        if run["backend"] == "command":
            raise Conflict(f"run {run_id} is a watched command: eaglewatch keeps no manifest for it")
        if run["backend"] in PIPELINES:
            raise Conflict(f"run {run_id} ran {run['backend']}, which writes no eaglewatch manifest")
        if run["shards"]:
            return await self.sharded.card(run)
        async with self.supervisors.link_for(run["host"]) as link:
            return await link.request("manifest", run=run_id, timeout=60)

    async def stop(self, run_id: str) -> dict[str, Any]:
        """Stop through the agent, then record the agent's status; Conflict when already finished."""
        run = await self.store.read(queries.run_row, run_id)
        if is_terminal(run["state"]):
            raise Conflict(f"run {run_id} is already {run['state']}")
        if run["shards"]:
            return await self.sharded.stop(run)
        if run["state"] == "pending" and not run.get("scheduler_job"):
            raise Conflict(f"run {run_id} is pending (not launched yet)")
        async with self.supervisors.link_for(run["host"]) as link:
            result = await link.request("stop", run=run_id, timeout=120)
            status = await link.request("status", run=run_id)
        state = status.get("state")
        if state in ("completed", "failed", "stopped", "lost"):
            ev = event_for_agent_state(str(state))
            await self.store.write(
                lambda tx: crud.transition(
                    tx=tx, run_id=run_id, event=ev, policy=self.policy, exit=status.get("exit")
                )
            )
        return result
