"""Run the real extraction job as a subprocess in its own process group; parse its EAGLEWATCH lines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class JobResult:
    """Exit status, the whole output and the parsed milestone lines."""

    rc: int
    output: str
    events: list[dict[str, Any]]

    def kinds(self) -> list[str]:
        """Milestone kinds in order."""
        return [e["kind"] for e in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The milestone lines of one kind."""
        return [e for e in self.events if e["kind"] == kind]


def parse_events(text: str) -> list[dict[str, Any]]:
    """Every `EAGLEWATCH {json}` object in a log."""
    out = []
    for line in text.splitlines():
        at = line.find("EAGLEWATCH ")
        if at >= 0:
            out.append(json.loads(line[at + len("EAGLEWATCH ") :]))
    return out


#: vLLM's engine core in the job's own process: an engine start costs ~25 s instead of ~50 s here (one Python
#: process importing torch and vLLM, not three). For tests whose subject is not vLLM's process layout
#: (sharding, Slurm, the controller's view of a run); the capture tests keep vLLM's default layout, which
#: is what users run.
IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def write_spec(path: Path, **fields: Any) -> Path:
    """A spec file with host 'local' and the given fields."""
    path.write_text(json.dumps({"host": "local", **fields}))
    return path


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the job: small KV cache, no hub access."""
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.update(extra or {})
    return env


def run_job(
    spec: Path,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    stop_when: Callable[[dict[str, Any]], bool] | None = None,
    args: tuple[str, ...] = (),
) -> JobResult:
    """Run `python -m agent.extract extract --spec SPEC [ARGS]`; SIGKILL its group once stop_when(event)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.extract", "extract", "--spec", str(spec), *args],
        cwd=ROOT,
        env=job_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if stop_when is not None and "EAGLEWATCH " in line and stop_when(parse_events(line)[0]):
                os.killpg(proc.pid, signal.SIGKILL)
                break
        rc = proc.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # engine core and workers share the group
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    text = "".join(lines)
    return JobResult(rc, text, parse_events(text))
