"""Small job scripts for the agent tests: real Python processes that print vLLM-style logs, crash, hang."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

#: vLLM lines as the real format strings print them (docs/vllm.md), one per phase.
VLLM_LINES = [
    "INFO 02-21 22:48:01 [core.py:105] Initializing a V1 LLM engine (v0.19.1) with config: model='/m', tp=1",
    "(Worker_TP0 pid=4242) INFO 02-21 22:48:02 [default_loader.py:384] Loading weights took 2.35 seconds",
    "(Worker_TP0 pid=4242) INFO 02-21 22:48:03 [gpu_model_runner.py:4820] Model loading took 1.2 GiB memory "
    "and 3.456789 seconds",
    "INFO 02-21 22:48:04 [kv_cache_utils.py:1087] GPU KV cache size: 123,456 tokens",
]

OOM_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/x/gpu_model_runner.py", line 10, in execute_model',
    "    hidden = self.model(input_ids)",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.19 GiB of which 1.06 GiB is free.",
]


def marker(kind: str, **fields: Any) -> str:
    """An EAGLEWATCH machine-readable line."""
    import json

    return "EAGLEWATCH " + json.dumps({"kind": kind, **fields})


def write_script(tmp: Path, name: str, body: str) -> list[str]:
    """Write a Python job script and return the argv that runs it."""
    path = tmp / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def printer(
    tmp: Path,
    lines: list[str],
    delay: float = 0.0,
    exit_code: int = 0,
    name: str = "printer",
    end_sleep: float = 0.0,
) -> list[str]:
    """A job printing ``lines`` (``delay`` s apart), sleeping ``end_sleep``, then exiting ``exit_code``."""
    return write_script(
        tmp,
        name,
        f"""
        import sys, time
        LINES = {lines!r}
        for i, line in enumerate(LINES):
            print(line, flush=True)
            if {delay!r}:
                time.sleep({delay!r})
        time.sleep({end_sleep!r})
        sys.exit({exit_code!r})
    """,
    )


def sleeper(tmp: Path, seconds: float = 300.0, ignore_term: bool = False, name: str = "sleeper") -> list[str]:
    """A job that sleeps (optionally ignoring SIGTERM, so stop has to SIGKILL it)."""
    return write_script(
        tmp,
        name,
        f"""
        import signal, time
        if {ignore_term!r}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("sleeping", flush=True)
        time.sleep({seconds!r})
    """,
    )


def forker(tmp: Path, pidfile: Path, name: str = "forker", parent_exits: bool = False) -> list[str]:
    """A job whose child setsid's away (like a vLLM worker), ignores SIGTERM and outlives its parent.

    ``parent_exits``: the parent ends (exit 0) as soon as the worker runs, leaving the worker behind.
    """
    return write_script(
        tmp,
        name,
        f"""
        import os, signal, sys, time
        pid = os.fork()
        if pid == 0:
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open({str(pidfile)!r} + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
            time.sleep(300)
            os._exit(0)
        while not os.path.exists({str(pidfile)!r}):
            time.sleep(0.01)
        print("parent exits, worker", pid, "lives on", flush=True)
        if not {parent_exits!r}:
            time.sleep(300)
    """,
    )
