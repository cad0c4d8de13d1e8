"""Pure pieces of the run operations (Controller in service.py): run ids, a spec checked against its hosts,
an agent's refusal of a host path as a field error, a Slurm host's launch options."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from agent.spec import RunSpec
from controller.errors import AgentError, SpecInvalid, Unreachable

#: The agent gives a forecast up to 300 s (agent/runs/output_info.py); the link waits a little longer.
FORECAST_TIMEOUT_S = 330


def new_run_id() -> str:
    """A sortable, unique run id: r-YYYYMMDD-HHMMSS-xxxx (UTC)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
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
            message = f"{spec.tensor_parallel_size} > {len(gpus)} GPUs on host {row['name']}"
            errors.append({"field": "tensor_parallel_size", "message": message})
    if spec.layers is not None and spec.expect.layers is not None and len(spec.layers) != spec.expect.layers:
        message = f"{len(spec.layers)} layer ids but expect.layers is {spec.expect.layers}"
        errors.append({"field": "layers", "message": message})
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
