"""Run the real extraction job as a subprocess in its own process group; parse its EAGLEWATCH lines."""

from __future__ import annotations

import contextlib
import json
import os
import random
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


#: vLLM's engine core and worker in the job's own process (in a server's engine core process): one Python
#: process imports torch and vLLM instead of three, the cheapest engine start. For every run whose subject
#: is not vLLM's process layout; the layout users run stays covered by the resumed Llama capture
#: (tests/extract/conftest.py) and TP=2.
IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


#: The tiny models' EAGLE-3 layers in the "input" convention: [2, N//2, N-3, N] for N = 8.
LAYERS = [2, 4, 5, 8]
#: The Llama capture's prompt lengths (tests/extract/conftest.py), up to 64 tokens.
LLAMA_LENGTHS = [5, 37, 12, 64, 1, 50, 23, 9, 41, 17]
#: Chunked prefill forced: 64-token prompts cross steps of at most 24 tokens, mixed with other prompts.
CHUNKED = ["--max-num-batched-tokens", "24", "--max-num-seqs", "4"]
#: float32 on any CPU: the job's own default where the CPU lacks bf16 kernels, asked for where it has them
#: (vLLM would downcast to bf16), so that captures compare with float32 references at a float32 tolerance.
FLOAT32 = ["--dtype", "float32"]
#: A bare spec's environment: an empty value unsets, so the job picks its own CPU defaults (KV-cache size,
#: thread binding) where jobrun would set a KV-cache size.
BARE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "", "VLLM_CPU_OMP_THREADS_BIND": ""}
#: The sharding tests' prompt lengths: shard 0 of 2 takes samples 0-2, shard 1 samples 3-6.
SHARD_LENGTHS = [5, 37, 12, 30, 1, 23, 9]


def token_dataset(path: Path, lengths: list[int], seed: int) -> list[list[int]]:
    """Write a JSONL dataset of random token ids, one sample per length; return the samples."""
    rng = random.Random(seed)
    samples = [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]
    path.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in samples))
    return samples


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
    """Run `python -m agent extract --spec SPEC [ARGS]`; SIGKILL its group once stop_when(event)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "extract", "--spec", str(spec), *args],
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
