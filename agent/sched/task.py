"""One Slurm task: ``python -m agent.sched.task RUN_DIR`` runs the job recorded in launch.json (the batch
script's only command). For an array job it tells the task its shard in ``EAGLEWATCH_SHARD``
(index = SLURM_ARRAY_TASK_ID): the argv runs exactly as recorded, and an extraction job reads its shard
from there (agent/extract/planning/preflight.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from agent import settings
from agent.paths import read_json


def main(argv: list[str]) -> int:
    """Exec the job; returns only when it cannot start (127, the reason on stderr)."""
    if len(argv) != 1:
        print("usage: python -m agent.sched.task RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    launch = read_json(run_dir / "launch.json")
    if not isinstance(launch, dict) or not isinstance(launch.get("argv"), list) or not launch["argv"]:
        print(f"eaglewatch-agent: {run_dir / 'launch.json'} is missing or malformed", file=sys.stderr)
        return 127
    args = [str(a) for a in launch["argv"]]
    env = {**os.environ, **{str(k): str(v) for k, v in (launch.get("env") or {}).items()}}
    env[settings.RUN_ID.name] = run_dir.name
    shards = launch.get("shards")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    if isinstance(shards, int) and task is not None and task.isdigit():
        env[settings.SHARD.name] = f"{int(task)}/{shards}"
    try:
        os.execvpe(args[0], args, env)
    except OSError as exc:
        print(f"eaglewatch-agent: cannot start {args[0]}: {exc.strerror or exc}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
