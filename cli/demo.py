"""`eaglewatch demo`: controller + web UI on 127.0.0.1, a local agent (no SSH), a tiny model, a real CPU run.

Everything lives under the demo home (database, agent state, tiny model, dataset, outputs). The host
``local`` is reached over pipes (``python -m agent connect``: the SSH protocol without SSH). The UI needs
a login even on loopback (other accounts can reach it): the demo prints a one-time link and a token, both
new at each start. ``--no-extract`` replaces the vLLM run with a quick milestone-printing command job.
Ctrl-C stops the demo's runs and its agent daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.backends import Backend
from agent.jobs import procfs
from agent.spec import parse_spec
from cli.terminal import TerminalView
from controller.errors import NotFound
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings, ensure_home
from web import security
from web.app import create_app
from web.forms import spec_to_form
from web.run_templates import TemplateStore
from web.sse import TERMINAL_STATES

DEMO_HOST = "local"
#: A fast stand-in job for --no-extract: milestone lines in the extraction job's own format and order (per
#: batch of two: a passed check per file, batch_captured, progress), then success.
FAKE_JOB = """
import json, sys, time
total = int(sys.argv[1])
def emit(kind, **fields):
    print("EAGLEWATCH " + json.dumps({"kind": kind, **fields}), flush=True)
emit("capture_configured", layers=[2, 4, 5, 8], hidden_size=128, dtype="float32", backend="command")
batch = 0
for start in range(0, total, 2):
    time.sleep(0.5)
    batch += 1
    done = min(total, start + 2)
    for idx in range(start, done):
        emit("shape_check_passed", file=f"hs_{idx}.safetensors", index=idx)
    emit("batch_captured", batch=batch, samples=done - start, tokens=32 * (done - start))
    emit("progress", samples_done=done, samples_total=total, tokens_per_s=100.0 * done)
emit("completed", samples=total)
"""
#: vLLM on CPU: a small KV cache, no hub access (docs/vllm.md).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class DemoPaths:
    """Where the demo keeps its pieces under its home."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.agent_state = home / "agent"  # the local agent daemon's state dir
        self.model = home / "tiny-llama"  # a tiny random-weight Llama
        self.dataset = home / "data" / "prompts.jsonl"
        self.fake_job = home / "demo_job.py"  # the script of the --no-extract job
        self.outputs = home / "outputs"


def write_dataset(path: Path, samples: int = 24) -> None:
    """Prompts in the tiny tokenizer's vocabulary ('w0'..'w495'), 16-48 words each; deterministic."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(samples):
        words = [f"w{(i * 37 + j * 11) % 496}" for j in range(16 + (i * 7) % 33)]
        lines.append(json.dumps({"text": " ".join(words)}))
    path.write_text("\n".join(lines) + "\n")


def extraction_spec(paths: DemoPaths, name: str, fault: str | None = None, out: str = "") -> dict[str, Any]:
    """A worker-extension run of the tiny model over the demo dataset (optionally with a fault injected)."""
    spec: dict[str, Any] = {
        "name": name,
        "host": DEMO_HOST,
        "backend": Backend.WORKER_EXTENSION,
        "model": str(paths.model),
        "dataset": str(paths.dataset),
        "output_dir": str(paths.outputs / (out or name)),
        "max_samples": 24,
        "seq_len": 64,
        "batch_size": 4,
        "env": dict(CPU_ENV),
        # vLLM picks bf16 for this fp32 model on CPU, and bf16 at the default batched-token budget can kill
        # the CPU worker with SIGILL on these machines; fp32 is also what the HF reference tests compare.
        "vllm_args": ["--dtype", "float32"],
    }
    if fault:
        spec["inject_fault"] = fault
    return spec


def command_spec(paths: DemoPaths, name: str, samples: int = 6) -> dict[str, Any]:
    """The --no-extract run: a backend-command job printing milestones (no vLLM, a few seconds)."""
    return {
        "name": name,
        "host": DEMO_HOST,
        "backend": Backend.COMMAND,
        # A script file rather than `-c CODE`: the New-run form keeps one argument per line.
        "command": [sys.executable, str(paths.fake_job), str(samples)],
    }


def build_model(paths: DemoPaths) -> None:
    """Build the tiny model once (``eaglewatch-agent tiny-model``) in a subprocess: no torch in here."""
    if (paths.model / "config.json").exists():
        return
    print(f"building the tiny model in {paths.model} ...", flush=True)
    argv = [sys.executable, "-m", "agent", "tiny-model", str(paths.model), "--arch", "llama"]
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, timeout=600)


def save_templates(home: Path, paths: DemoPaths, extract: bool) -> None:
    """Saved New-run templates: the good run and the broken one (each load picks a new folder in outputs/)."""
    store = TemplateStore(home)
    if extract:
        outputs = {"output_dir": str(paths.outputs)}
        store.save("demo tiny llama", {**spec_to_form(extraction_spec(paths, "demo-2")), **outputs})
        broken = spec_to_form(extraction_spec(paths, "demo-broken", "drop_layer"))  # shape checks fail
        store.save("demo broken - drops a layer", {**broken, **outputs})
    else:
        store.save("demo command job", spec_to_form(command_spec(paths, "demo-2")))


#: Held (flock) by the demo serving a home, and holding its URL: a second demo on that home refuses.
LOCK_FILE = "demo.lock"


def hold_home(home: Path) -> int | None:
    """Lock ``home`` for this demo (an fd to keep open while it runs), or None (said where the demo holding
    it runs): two demos on one home would share its agent and each other's events."""
    fd = os.open(home / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        url = os.read(fd, 4096).decode(errors="replace").strip()
        os.close(fd)
        where = f"at {url}" if url else "(still starting)"
        print(
            f"eaglewatch demo: another eaglewatch demo runs on {home} {where}: use it, stop it, or give this "
            "one --home DIR",
            file=sys.stderr,
            flush=True,
        )
        return None
    os.ftruncate(fd, 0)
    return fd


def agent_request(
    sock_path: Path, requests: list[dict[str, Any]], timeout: float = 30.0
) -> list[dict[str, Any]]:
    """Send requests to the local agent daemon over its socket; their replies in order (stdlib client)."""
    replies = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(sock_path))
        with sock.makefile("rwb") as f:
            f.readline()  # hello
            for i, req in enumerate(requests, 1):
                f.write(json.dumps({"id": i, **req}).encode() + b"\n")
                f.flush()
                while True:
                    msg = json.loads(f.readline())
                    if msg.get("id") == i and msg.get("type") in ("reply", "error"):
                        replies.append(msg)
                        break
    return replies


def stop_agent(paths: DemoPaths) -> None:
    """Stop every running run of the demo's agent, then the daemon itself."""
    sock = paths.agent_state / "agent.sock"
    if not sock.exists():
        return
    try:
        [listing] = agent_request(sock, [{"op": "list"}])
        running = [r["run"] for r in listing.get("result", {}).get("runs", []) if r.get("state") == "running"]
        agent_request(sock, [*({"op": "stop", "run": r, "grace_s": 5} for r in running), {"op": "shutdown"}])
        for run in running:
            print(f"stopped run {run}", flush=True)
    except (OSError, ValueError) as exc:
        print(f"could not stop the demo agent cleanly: {exc}", file=sys.stderr, flush=True)
    _end_daemons(paths.agent_state)


def daemons_of(state_dir: Path) -> list[int]:
    """Pids of `agent daemon` processes serving exactly this state dir (one may wait for the other's lock)."""
    wanted = f" agent daemon --state-dir {state_dir} "
    return [
        pid
        for pid in procfs.pids()
        if (st := procfs.stat(pid)) is not None and st.state != "Z" and wanted in f" {procfs.cmdline(pid)} "
    ]


def _end_daemons(state_dir: Path, grace_s: float = 2.0, timeout_s: float = 15.0) -> None:
    """Wait for the demo's daemons to exit after `shutdown`, then SIGTERM what remains (jobs are stopped)."""
    start = time.monotonic()
    while daemons_of(state_dir) and time.monotonic() - start < grace_s:
        time.sleep(0.1)
    # A second daemon may be waiting for the state dir's lock (two bridges raced at start): end it too.
    for pid in daemons_of(state_dir):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    while daemons_of(state_dir) and time.monotonic() - start < timeout_s:
        time.sleep(0.1)


class Echo:
    """What the demo's terminal prints of the bus, in words: one line per batch, each kind of problem once
    (where it was first seen), alerts, and the verdict once a run has ended (again only if later checks
    change it)."""

    def __init__(self) -> None:
        self._views: dict[str, TerminalView] = {}
        self._problems: set[tuple[str, str]] = set()
        self._verdicts: dict[str, str] = {}

    def event(self, kind: str, run: str, data: dict[str, Any]) -> list[str]:
        """The lines to print for one bus event (``kind``: milestone, run, alert…) of ``run``."""
        said: list[str] = []
        if kind == "milestone":
            what, text = str(data.get("kind")), str(data.get("text") or "")
            fields = dict(data["fields"]) if isinstance(data.get("fields"), dict) else {}
            if what != "shape_check_failed":
                said = [
                    line for line, _ in self._views.setdefault(run, TerminalView()).stored(what, fields, text)
                ]
            elif (run, code := str(fields.get("code") or "problem")) not in self._problems:
                self._problems.add((run, code))
                said = [f"problem {code}: {fields.get('message') or text} (first in {fields.get('file')})"]
        elif kind == "run" and data.get("state") in TERMINAL_STATES:
            said = [line for line, _ in self._views.pop(run, TerminalView()).flush()]
            verdict = str(data.get("verdict_text") or data.get("state"))
            if self._verdicts.get(run) != verdict:
                self._verdicts[run] = verdict
                said.append(f"verdict: {verdict}")
        elif kind == "alert":
            said = [f"ALERT: {data.get('message', data)}"]
        return [f"  run {run}: {line}" for line in said]


async def _echo_milestones(ctl: Controller) -> None:
    """Print the bus's events on the terminal as they arrive (Echo)."""
    echo = Echo()
    async for event in ctl.bus.subscribe():
        for line in echo.event(event.kind, str(event.run_id), event.data):
            print(line, flush=True)


async def _start_server(app: Any, bind: str, port: int) -> tuple[Any, asyncio.Task[None], int]:
    """Start uvicorn in this loop; return the server, its task and the port it listens on."""
    import uvicorn

    class DemoServer(uvicorn.Server):
        """uvicorn re-raises a captured SIGINT/SIGTERM after shutdown, which would skip the demo's cleanup."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = DemoServer(uvicorn.Config(app, host=bind, port=port, log_level="warning", lifespan="on"))

    def on_signal() -> None:
        server.force_exit = server.should_exit  # a second Ctrl-C skips the graceful wait
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it (port in use...)
            raise RuntimeError("the web server stopped before it started")
        await asyncio.sleep(0.05)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return server, task, int(bound)


async def _demo(home: Path, bind: str, port: int, extract: bool, broken: bool, lock: int) -> int:
    paths = DemoPaths(home)
    (home / security.TOKEN_FILE).unlink(missing_ok=True)  # a new login token at each start
    token = security.ensure_token(home)
    settings = Settings(home=home, bind=bind, port=port)
    ctl = Controller(settings)
    app = create_app(ctl, bind=bind, require_auth=True, manage_controller=True)
    server, serve_task, bound = await _start_server(app, bind, port)
    echo = asyncio.create_task(_echo_milestones(ctl))
    try:
        try:
            await ctl.get_host(DEMO_HOST)
        except NotFound:
            await ctl.add_host(HostCreate(name=DEMO_HOST, ssh="local", state_dir=str(paths.agent_state)))
        write_dataset(paths.dataset)
        paths.fake_job.write_text(FAKE_JOB)
        if extract:
            await asyncio.to_thread(build_model, paths)
        save_templates(home, paths, extract)
        url = f"http://{bind}:{bound}/"
        os.pwrite(lock, url.encode() + b"\n", 0)  # what a second demo on this home prints
        link = f"{url}login/link?code={app.state.login_links.issue()}"
        minutes = round(app.state.login_links.ttl_s / 60)
        print(
            f"\neaglewatch demo is running (home {home})\n"
            f"  open:  {link}\n"
            f"         (logs this browser in: the link works once, within {minutes} minutes)\n"
            f"  URL:   {url}\n"
            f"  token: {token}   (to log in at the URL from another browser, or once the link is used)\n"
            f"  CLI:   export EAGLEWATCH_HOME={shlex.quote(str(home))}   (then: eaglewatch runs ls)\n",
            flush=True,
        )
        if extract:
            # A fresh output directory per start: a finished one would be resumed (nothing left to do).
            stamp = time.strftime("%Y%m%d-%H%M%S")
            first = await ctl.create_run(parse_spec(extraction_spec(paths, "demo-1", out=f"demo-1-{stamp}")))
            if broken:
                broken_spec = extraction_spec(paths, "demo-broken", "drop_layer", f"demo-broken-{stamp}")
                await ctl.create_run(parse_spec(broken_spec))
        else:
            first = await ctl.create_run(parse_spec(command_spec(paths, "demo-1")))
        print(f"  first run: {url}runs/{first}\n  Ctrl-C stops the demo and its runs.\n", flush=True)
        await serve_task
    finally:
        echo.cancel()
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await serve_task
        await asyncio.to_thread(stop_agent, paths)
    return 0


def run_demo(*, home: Path | None, bind: str, port: int, extract: bool, broken: bool) -> int:
    """Run the embedded demo until Ctrl-C; returns the exit status."""
    home = (home or Settings().demo_home).expanduser().resolve()
    ensure_home(home)
    lock = hold_home(home)
    if lock is None:
        return 1
    try:
        return asyncio.run(_demo(home, bind, port, extract, broken, lock))
    except KeyboardInterrupt:
        return 0
    finally:
        os.close(lock)
