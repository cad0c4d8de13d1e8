"""Run a user's own pipeline as the job: SpecForge's torchrun, or speculators' server then client.

How either runs (forecast, disk progress lines, the tagged relay, the server's teardown log):
docs/extraction.md, "speculators and SpecForge". The children run in the job's process group, so the
agent's stop ends them too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from agent.backends import Backend
from agent.extract import signals
from agent.extract.engine.setup import platform_defaults
from agent.extract.pipelines.disk import DiskWatch
from agent.extract.pipelines.forecast import forecast_pipeline, specforge_total
from agent.extract.pipelines.plan import PairPlan, Process, server_defaults, specforge_argv, speculators_plan
from agent.extract.planning.forecast import Forecast, refuse_overrun
from agent.extract.planning.preflight import SpecError, text_config
from agent.spec import RunSpec

STAGING = ".staging-speculators"  # inside output_dir: one filesystem, so speculators' move is a rename
POLL_S = 1.0
PROBE_TIMEOUT_S = 300.0  # importing vLLM on a loaded host; the server itself gets ready_timeout_s
STOP_GRACE_S = 30.0
MAX_LINE_BYTES = 1 << 20
TEARDOWN_LOG = "server-teardown.log"  # in the job's directory (the run's directory under the agent)


def run_pipeline(spec: RunSpec) -> int:
    """Run backend ``speculators`` or ``specforge`` for a validated spec; the job's exit status."""
    opts = spec.speculators if spec.backend == Backend.SPECULATORS else spec.specforge
    python = (opts.python if opts is not None else None) or sys.executable
    out = spec.output_dir or ""
    os.makedirs(out, exist_ok=True)
    need: Forecast | None = None
    try:
        need = forecast_pipeline(spec)
    except (SpecError, OSError) as e:  # the data cannot be read here: start anyway
        signals.say(f"no disk forecast: {e}")
    else:
        signals.emit("forecast", **need.to_dict())
        if refuse_overrun(need, out, spec.allow_disk_overrun):
            return 2
    total = need.samples if need is not None else None
    if spec.backend == Backend.SPECFORGE:
        total = specforge_total(spec)
        if total is not None:  # SpecForge's bar counts batches: the total makes percent and ETA possible
            signals.emit("progress", rule="pipeline_total", samples_done=0, samples_total=total)
    disk = DiskWatch(out, total, need.bytes if need is not None else 0, spec.disk_low_gib * 2**30)
    if spec.backend == Backend.SPECFORGE:
        argv = specforge_argv(spec, python)
        signals.say(f"starting SpecForge: {' '.join(argv)}")
        return _run_child(argv, disk)
    try:
        config = text_config(Path(spec.model or ""))
        layers = int(config["num_hidden_layers"])
    except (SpecError, KeyError, TypeError, ValueError) as e:
        signals.emit("failed", reason=f"cannot read num_hidden_layers of {spec.model}: {e}")
        return 2
    try:
        platform = server_platform(python)
    except PlatformUnknown as e:
        signals.emit("failed", reason=str(e), process="server")
        return 2
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    engine = platform_defaults(platform, os.environ, spec.vllm_args, spec.tensor_parallel_size, dtype)
    defaults = server_defaults(platform, spec.vllm_args, engine)
    signals.emit(
        "engine_config",
        source="eaglewatch",
        process="server",
        platform=platform,
        defaults={**defaults.env, **({"vllm_args": defaults.args} if defaults.args else {})},
        reasons=defaults.reasons,
    )
    for key, why in defaults.reasons.items():
        signals.say(f"server default {key}: {why}")
    for message in defaults.warnings:
        signals.emit("warning", source="eaglewatch", message=message, process="server")
    plan = speculators_plan(spec, python, layers, os.path.join(out, STAGING), platform, defaults)
    return PairRunner(plan, disk).run()


#: Asks the server's Python which platform vLLM will run on, as the server will (its own plugin order).
_PLATFORM_PROBE = (
    "from vllm.platforms import current_platform as p; print('cpu' if p.is_cpu() else p.device_type)"
)


class PlatformUnknown(RuntimeError):
    """The server's Python cannot tell which platform vLLM runs on (so neither could the server start)."""


def server_platform(python: str) -> str:
    """vLLM's device type as ``python`` sees it on this host: "cuda", "cpu", …"""
    try:
        done = subprocess.run(
            [python, "-c", _PLATFORM_PROBE],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except OSError as e:  # the same words as for any program of the job that cannot start
        raise PlatformUnknown(f"cannot start {e.filename or python}: {e.strerror or e}") from None
    except subprocess.TimeoutExpired:
        raise PlatformUnknown(f"{python} did not tell vLLM's platform within {PROBE_TIMEOUT_S:g} s") from None
    words = done.stdout.split()
    if done.returncode != 0 or not words:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PlatformUnknown(
            f"{python} cannot import vLLM to tell its platform (exit {done.returncode}): {last}"
        )
    return words[-1]


def _run_child(argv: list[str], disk: DiskWatch) -> int:
    """SpecForge: torchrun as our child in our process group, its output straight to the job log; its exit
    status (128 + signal when a signal ended it), or 127 when it cannot start."""
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    except OSError as e:
        signals.emit("failed", reason=f"cannot start {argv[0]}: {e.strerror or e}")
        return 127

    # The agent's stop signals our whole group, torchrun too; a signal to us alone is passed on. Either
    # way we wait for torchrun to end and report its status.
    def pass_on(_signum: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, pass_on)
    done = threading.Event()
    disk.start(done, signals.emit)
    try:
        code = child.wait()
    finally:
        done.set()
    signals.emit("progress", **disk.fields())  # what the attempt wrote in the end, whatever the interval
    return 128 - code if code < 0 else code


class PairRunner:
    """Server, readiness, client, teardown; every child line relayed to stdout behind its tag."""

    def __init__(self, plan: PairPlan, disk: DiskWatch) -> None:
        self.plan = plan
        self.disk = disk
        self.done = threading.Event()
        self.out: IO[bytes] = sys.stdout.buffer
        self.lock = threading.Lock()
        self.children: list[subprocess.Popen[bytes]] = []
        self.relays: list[threading.Thread] = []
        self.stopping = False
        # Once the client is done the run's outcome is known: what the server prints while it is torn down
        # (vLLM aborts its engine, which may log EngineDeadError) goes to this file, not into the watched log.
        self.teardown: IO[bytes] | None = None

    def say(self, message: str) -> None:
        """One line of our own, written between the children's lines."""
        with self.lock:
            sys.stdout.flush()
            self.out.write(f"[eaglewatch] {message}\n".encode())
            self.out.flush()

    def emit(self, kind: str, **fields: object) -> None:
        """One milestone marker line."""
        with self.lock:
            self.out.write((signals.format_line(kind, **fields) + "\n").encode())
            self.out.flush()

    def start(self, proc: Process) -> subprocess.Popen[bytes]:
        """Start one child in our process group, its stdout and stderr relayed behind its tag."""
        self.say(f"starting {proc.tag}: {' '.join(proc.argv)}")
        child = subprocess.Popen(
            proc.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **proc.env},
        )
        self.children.append(child)
        assert child.stdout is not None
        relay = threading.Thread(target=self._relay, args=(proc.tag, child.stdout), daemon=True)
        relay.start()
        self.relays.append(relay)
        return child

    def _relay(self, tag: str, stream: IO[bytes]) -> None:
        prefix = f"[{tag}] ".encode()
        pending = b""
        while chunk := stream.read1(65536):  # type: ignore[attr-defined]
            pending += chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            *lines, pending = pending.split(b"\n")
            if len(pending) > MAX_LINE_BYTES:  # no newline for this long: pass it on rather than hold it
                lines, pending = [*lines, pending], b""
            # rich pads each record to the console width: the padding only fills the log
            self._write(tag, [prefix + ln.rstrip() for ln in lines if ln.strip()])
        if pending.strip():
            self._write(tag, [prefix + pending.rstrip()])

    def _write(self, tag: str, lines: list[bytes]) -> None:
        if not lines:
            return
        with self.lock:
            out = self.teardown if self.teardown is not None and tag == self.plan.server.tag else self.out
            out.write(b"".join(ln + b"\n" for ln in lines))
            out.flush()

    def _ready(self, server: subprocess.Popen[bytes]) -> str | None:
        """None once the server answers its health check; else why it never will."""
        deadline = time.monotonic() + self.plan.ready_timeout_s
        while time.monotonic() < deadline:
            if self.stopping:
                return "stopped while waiting for the server"
            code = server.poll()
            if code is not None:
                return f"the server exited with status {code} before it was ready"
            try:
                with urllib.request.urlopen(self.plan.health_url, timeout=POLL_S) as resp:
                    if resp.status == 200:
                        return None
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(POLL_S)
        return f"the server did not answer {self.plan.health_url} within {self.plan.ready_timeout_s:g} s"

    def _terminate(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for relay in self.relays:
            relay.join(5.0)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """The whole job; the client's exit status, or 1 when the server failed it."""
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            return self._run()
        except OSError as e:  # a program that cannot be started: python or a script path is wrong
            self.emit("failed", reason=f"cannot start {e.filename or 'a process'}: {e.strerror or e}")
            return 127
        finally:
            self.done.set()
            self._terminate()
            if self.teardown is not None:
                self.teardown.close()

    def _run(self) -> int:
        server = self.start(self.plan.server)
        problem = self._ready(server)
        if problem is not None:
            self.emit("failed", reason=problem, process="server")
            return 1
        self.emit("engine_config", rule="pipeline_server_ready", process="server", url=self.plan.health_url)
        client = self.start(self.plan.client)
        self.disk.start(self.done, self.emit)
        while (code := client.poll()) is None:
            if server.poll() is not None and not self.stopping:
                self.emit(
                    "failed",
                    reason=f"the server exited with status {server.returncode}",
                    process="server",
                )
                return 1
            time.sleep(0.2)
        self.done.set()
        # what the attempt wrote in the end, whatever the interval
        self.emit("progress", **self.disk.fields())
        if not self.stopping:
            name = os.path.abspath(TEARDOWN_LOG)
            self.say(f"client exited with status {code}; stopping the server (its last lines: {name})")
            with self.lock:
                self.teardown = open(name, "ab")  # noqa: SIM115 - closed in run() after the relays end
        return 143 if self.stopping else code
