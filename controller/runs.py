"""Run operations: validate a spec, write the run (pending) first, launch and stop through the agent."""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any

from pydantic import ValidationError

from agent.spec import PIPELINE_BACKENDS, RunSpec
from controller import crud, queries
from controller.alerts import AlertPolicy
from controller.errors import AgentError, Conflict, NotFound, SpecInvalid, Unreachable
from controller.fleet import Supervisors
from controller.lifecycle import RunEvent, event_for_agent_state, is_terminal
from controller.settings import Settings
from controller.shardruns import ShardOps
from controller.store import Store, Tx

#: Runs that may be resumed (an extraction that ended without finishing).
RESUMABLE_STATES = ("failed", "stopped", "lost")

#: The agent gives a forecast up to 300 s (agent/runs/output_info.py); the link waits a little longer.
FORECAST_TIMEOUT_S = 330


def new_run_id(now: float | None = None) -> str:
    """A sortable, unique run id: r-YYYYMMDD-HHMMSS-xxxx (UTC)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now or time.time()))
    return f"r-{stamp}-{secrets.token_hex(2)}"


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


def validate_spec(spec: dict[str, Any] | RunSpec, hosts: dict[str, dict[str, Any] | None]) -> RunSpec:
    """Validate a spec against the model and what is known about its hosts (name → row, None when there
    is no such host); raises SpecInvalid."""
    if isinstance(spec, RunSpec):
        parsed = spec
    else:
        if not isinstance(spec, dict):
            raise SpecInvalid([{"field": "spec", "message": "a run spec must be a JSON object"}])
        try:
            parsed = RunSpec.model_validate(spec)
        except ValidationError as exc:
            errs = validation_errors(exc)
            errs.extend(_unknown_hosts(hosts))
            raise SpecInvalid(errs) from None
    errors = _unknown_hosts(hosts)
    for row in (r for r in hosts.values() if r is not None):
        gpus = json.loads(row.get("gpus_json") or "[]")
        # A Slurm login node's own GPUs say nothing of the compute nodes' (Slurm refuses what none has).
        if gpus and row.get("scheduler") != "slurm" and parsed.tensor_parallel_size > len(gpus):
            errors.append(
                {
                    "field": "tensor_parallel_size",
                    "message": f"{parsed.tensor_parallel_size} > {len(gpus)} GPUs on host {row['name']}",
                }
            )
    if (
        parsed.layers is not None
        and parsed.expect.layers is not None
        and len(parsed.layers) != parsed.expect.layers
    ):
        errors.append(
            {
                "field": "layers",
                "message": f"{len(parsed.layers)} layer ids but expect.layers is {parsed.expect.layers}",
            }
        )
    if errors:
        raise SpecInvalid(errors)
    return parsed


def _unknown_hosts(hosts: dict[str, dict[str, Any] | None]) -> list[dict[str, str]]:
    return [
        {"field": "host", "message": f"no host named {name!r} (add it with: hosts add)"}
        for name, row in hosts.items()
        if row is None
    ]


def spec_hosts(spec: dict[str, Any] | RunSpec) -> list[str]:
    """The host names a spec names (before validation: whatever strings it holds)."""
    if isinstance(spec, RunSpec):
        return spec.hosts
    given = spec.get("host") if isinstance(spec, dict) else None
    names = [given] if isinstance(given, str) else given if isinstance(given, list) else []
    return [n for n in names if isinstance(n, str) and n][:64]


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

    resumable = RESUMABLE_STATES
    new_id = staticmethod(new_run_id)

    def __init__(
        self, settings: Settings, store: Store, supervisors: Supervisors, policy: AlertPolicy
    ) -> None:
        self.settings = settings
        self.store = store
        self.supervisors = supervisors
        self.policy = policy
        self.sharded = ShardOps(self)

    async def _validated(self, spec: dict[str, Any] | RunSpec) -> RunSpec:
        """The spec validated against the model and its host as stored; raises SpecInvalid."""
        hosts: dict[str, dict[str, Any] | None] = {}
        for name in spec_hosts(spec):
            try:
                hosts[name] = await self.store.read(queries.host_row, name)
            except NotFound:
                hosts[name] = None
        return validate_spec(spec, hosts)

    async def create(self, spec: dict[str, Any] | RunSpec, resumed_from: str | None = None) -> str:
        """Validate, write pending, launch; a failed launch leaves a failed run with the reason.

        A spec with ``shards`` > 1 becomes one sharded run of several jobs (controller/shardruns.py)."""
        parsed = await self._validated(spec)
        if parsed.shards > 1:
            return await self.sharded.create(parsed)
        run_id = new_run_id()
        spec_dict = parsed.model_dump(mode="json")

        def insert(tx: Tx) -> None:
            crud.insert_run(
                tx=tx,
                run_id=run_id,
                name=parsed.name,
                host=parsed.hosts[0],
                backend=parsed.backend,
                model=parsed.model,
                spec_json=json.dumps(spec_dict),
                resumed_from=resumed_from,
            )
            crud.transition(tx=tx, run_id=run_id, event=RunEvent.LAUNCH, policy=self.policy)

        await self.store.write(insert)
        await self.launch(run_id, parsed.hosts[0], spec_dict)
        return run_id

    async def launch(
        self, run_id: str, host: str, spec_dict: dict[str, Any], array: tuple[int, list[int]] | None = None
    ) -> None:
        """Ask ``host``'s agent to launch a written (starting) run; a refusal fails it with the reason.

        ``array`` (shards, task ids): on a Slurm host, one array job running those shards of the run."""
        try:
            row = await self.store.read(queries.host_row, host)
        except NotFound:
            row = {}
        extra = {"scheduler": sched} if (sched := scheduler_args(row)) else {}
        if sched is not None and array is not None:
            sched.update(shards=array[0], tasks=array[1])
        try:
            async with self.supervisors.link_for(host) as link:
                result = await link.request("launch", run=run_id, spec=spec_dict, timeout=120, **extra)
        except (AgentError, Unreachable) as exc:
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
        return await self.create(json.loads(run["spec_json"]), resumed_from=run_id)

    async def forecast(self, spec: dict[str, Any] | RunSpec) -> dict[str, Any]:
        """The host's forecast for a spec (bytes to write, free bytes, fits, estimated); launches nothing.

        A spec the job cannot forecast (no such model or dataset on the host) is SpecInvalid on `spec`.
        """
        parsed = await self._validated(spec)
        if parsed.backend == "command":
            raise SpecInvalid([{"field": "backend", "message": "a watched command has no forecast"}])
        try:
            async with self.supervisors.link_for(parsed.hosts[0]) as link:
                spec_dict = parsed.model_dump(mode="json")
                return await link.request("forecast", spec=spec_dict, timeout=FORECAST_TIMEOUT_S)
        except AgentError as exc:
            if exc.agent_code in ("failed", "bad_args"):
                message = exc.message.removeprefix(f"agent: {exc.agent_code}: ")
                raise SpecInvalid([{"field": "spec", "message": f"no forecast: {message}"}]) from None
            raise

    async def card(self, run_id: str) -> dict[str, Any]:
        """The run's dataset card: its manifest.json as the host has it now (without the per-sample map)."""
        run = await self.store.read(queries.run_row, run_id)
        if run["backend"] == "command":
            raise Conflict(f"run {run_id} is a watched command: eaglewatch keeps no manifest for it")
        if run["backend"] in PIPELINE_BACKENDS:
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
