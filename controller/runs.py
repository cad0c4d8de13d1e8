"""Run operations: validate a spec, write the run (pending) first, launch and stop through the agent."""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any

from pydantic import ValidationError

from agent.spec import RunSpec
from controller import crud, queries
from controller.alerts import AlertPolicy
from controller.errors import AgentError, Conflict, NotFound, SpecInvalid, Unreachable
from controller.fleet import Supervisors
from controller.lifecycle import RunEvent, event_for_agent_state, is_terminal
from controller.settings import Settings
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


def validate_spec(spec: dict[str, Any] | RunSpec, host: dict[str, Any] | None) -> RunSpec:
    """Validate a spec against the model and what is known about its host; raises SpecInvalid."""
    if isinstance(spec, RunSpec):
        parsed = spec
    else:
        if not isinstance(spec, dict):
            raise SpecInvalid([{"field": "spec", "message": "a run spec must be a JSON object"}])
        try:
            parsed = RunSpec.model_validate(spec)
        except ValidationError as exc:
            errs = validation_errors(exc)
            if host is None and isinstance(spec.get("host"), str) and spec["host"]:
                errs.append({"field": "host", "message": f"no host named {spec['host']!r}"})
            raise SpecInvalid(errs) from None
    errors: list[dict[str, str]] = []
    if host is None:
        errors.append({"field": "host", "message": f"no host named {parsed.host!r} (add it with: hosts add)"})
    else:
        gpus = json.loads(host.get("gpus_json") or "[]")
        # A Slurm login node's own GPUs say nothing of the compute nodes' (Slurm refuses what none has).
        if gpus and host.get("scheduler") != "slurm" and parsed.tensor_parallel_size > len(gpus):
            errors.append(
                {
                    "field": "tensor_parallel_size",
                    "message": f"{parsed.tensor_parallel_size} > {len(gpus)} GPUs on host {host['name']}",
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

    def __init__(
        self, settings: Settings, store: Store, supervisors: Supervisors, policy: AlertPolicy
    ) -> None:
        self.settings = settings
        self.store = store
        self.supervisors = supervisors
        self.policy = policy

    async def _validated(self, spec: dict[str, Any] | RunSpec) -> RunSpec:
        """The spec validated against the model and its host as stored; raises SpecInvalid."""
        host_name = (
            spec.host if isinstance(spec, RunSpec) else (spec.get("host") if isinstance(spec, dict) else None)
        )
        host = None
        if isinstance(host_name, str):
            try:
                host = await self.store.read(queries.host_row, host_name)
            except NotFound:
                host = None
        return validate_spec(spec, host)

    async def create(self, spec: dict[str, Any] | RunSpec, resumed_from: str | None = None) -> str:
        """Validate, write pending, launch; a failed launch leaves a failed run with the reason."""
        parsed = await self._validated(spec)
        run_id = new_run_id()
        spec_dict = parsed.model_dump(mode="json")

        def insert(tx: Tx) -> None:
            crud.insert_run(
                tx=tx,
                run_id=run_id,
                name=parsed.name,
                host=parsed.host,
                backend=parsed.backend,
                model=parsed.model,
                spec_json=json.dumps(spec_dict),
                resumed_from=resumed_from,
            )
            crud.transition(tx=tx, run_id=run_id, event=RunEvent.LAUNCH, policy=self.policy)

        await self.store.write(insert)
        try:
            host = await self.store.read(queries.host_row, parsed.host)
        except NotFound:
            host = {}
        extra = {"scheduler": sched} if (sched := scheduler_args(host)) else {}
        try:
            async with self.supervisors.link_for(parsed.host) as link:
                result = await link.request("launch", run=run_id, spec=spec_dict, timeout=120, **extra)
        except (AgentError, Unreachable) as exc:
            reason = f"launch failed: {exc.message}"
            await self.store.write(
                lambda tx: crud.transition(
                    tx=tx, run_id=run_id, event=RunEvent.LAUNCH_FAILED, policy=self.policy, reason=reason
                )
            )
            return run_id

        def launched(tx: Tx) -> None:
            job = result.get("job_id") if result.get("scheduler") == "slurm" else None
            crud.set_pid(tx=tx, run_id=run_id, pid=result.get("pid"), scheduler_job=job)
            # A Slurm job waits in the queue first: pending (with its job id) until the agent says running.
            event = RunEvent.LAUNCHED if job is None else RunEvent.JOB_PENDING
            crud.transition(tx=tx, run_id=run_id, event=event, policy=self.policy)

        await self.store.write(launched)
        self.supervisors.poke(parsed.host)
        return run_id

    async def resume(self, run_id: str) -> str:
        """A new run with the same spec, linked to ``run_id``: the job keeps the files already written and
        captures only the missing or invalid ones.  Conflict unless an extraction that did not finish."""
        run = await self.store.read(queries.run_row, run_id)
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
            async with self.supervisors.link_for(parsed.host) as link:
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
        async with self.supervisors.link_for(run["host"]) as link:
            return await link.request("manifest", run=run_id, timeout=60)

    async def stop(self, run_id: str) -> dict[str, Any]:
        """Stop through the agent, then record the agent's status; Conflict when already finished."""
        run = await self.store.read(queries.run_row, run_id)
        if is_terminal(run["state"]):
            raise Conflict(f"run {run_id} is already {run['state']}")
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
