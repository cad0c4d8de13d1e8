"""GPU host check, run on the lent H200 (device tool): the agent daemon's GPU discovery, a job holding GPU
memory launched through the daemon, and its stop confirming the memory was released.

Usage (repo root on the GPU machine): ``python3 tests/ops/h200/agent_gpu_check.py TRANSCRIPT [--gib N]``.
Exits 0 only when every check holds. Runs the real daemon (``python3 -m agent daemon``) over its Unix socket.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SMI_GPU = [
    "nvidia-smi",
    "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,temperature.gpu",
    "--format=csv,noheader,nounits",
]
SMI_APPS = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]
# A job that takes N GiB of GPU memory, says so, and sleeps.
HOLD = (
    "import os, sys, time, torch\n"
    "n = int(sys.argv[1]) * 1024**3\n"
    "x = torch.empty(n, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()\n"
    "print(f'holding {n >> 30} GiB in pid {os.getpid()}', flush=True)\n"
    "time.sleep(600)\n"
)
# A stubborn job, like a vLLM engine whose worker leaves the process group: the parent ignores SIGTERM and
# starts a worker in a new session that holds GPU memory.
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "w = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], start_new_session=True)\n"
    "print(f'parent ignores SIGTERM; worker {w.pid} in its own session', flush=True)\n"
    "time.sleep(600)\n"
)

LOG: list[str] = []
FAILURES: list[str] = []


def say(text: str) -> None:
    """Print a transcript line with a timestamp."""
    line = f"[{time.strftime('%H:%M:%S')}] {text}"
    print(line, flush=True)
    LOG.append(line)


def check(ok: bool, what: str) -> None:
    """Record one check."""
    say(("PASS " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def sh(argv: list[str]) -> str:
    """Run a command, put its output in the transcript, return it."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    say("$ " + " ".join(argv) + "\n" + (out.stdout + out.stderr).rstrip())
    return out.stdout


class Client:
    """A small sync JSON-lines client of the daemon's socket."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.file = self.sock.makefile("rwb")
        self.next_id = 0
        self.hello = json.loads(self.file.readline())

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one request, return its reply (skipping streamed messages)."""
        self.next_id += 1
        request = {"id": self.next_id, "op": op, **args}
        say(">>> " + json.dumps(request)[:400])
        self.file.write(json.dumps(request).encode() + b"\n")
        self.file.flush()
        while True:
            msg = json.loads(self.file.readline())
            if msg.get("id") == self.next_id and msg.get("type") in ("reply", "error"):
                say("<<< " + json.dumps(msg)[:3000])
                return msg


def wait_for(predicate: Any, timeout_s: float, what: str) -> bool:
    """Poll predicate until true or timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    say(f"timed out after {timeout_s} s waiting for {what}")
    return False


def used_mib() -> int:
    """GPU 0's used memory according to nvidia-smi."""
    out = subprocess.run(SMI_GPU, capture_output=True, text=True, check=True).stdout
    return int(out.splitlines()[0].split(",")[4])


def hold_run(client: Client, state: Path, run: str, argv: list[str], gib: int) -> None:
    """Launch a run through the daemon, see its memory in nvidia-smi and the gpus op, stop it, check."""
    baseline = used_mib()  # others' memory on a shared GPU is not ours to see released
    spec = {"name": run, "host": "h200", "backend": "command", "command": argv}
    reply = client.call("launch", run=run, spec=spec)
    check(reply.get("ok") is True, f"{run}: launch accepted")
    log = state / "runs" / run / "output.log"
    held = wait_for(
        lambda: log.exists() and log.read_text().count("holding") >= 1, 120, f"{run} to hold memory"
    )
    check(held, f"{run}: job reports holding {gib} GiB")
    say(f"{run} output.log:\n" + (log.read_text() if log.exists() else "(none)"))
    sh(SMI_APPS)
    sh(["nvidia-smi"])
    gpus = client.call("gpus")["result"]
    pids = {p["pid"] for p in gpus["processes"]}
    mem = sum(p["used_memory_mib"] or 0 for p in gpus["processes"])
    check(bool(pids) and mem >= gib * 1024, f"{run}: gpus op lists pids {sorted(pids)} holding {mem} MiB")
    status = client.call("status", run=run)["result"]
    check(status["state"] == "running", f"{run}: status running")
    before = used_mib()
    stop = client.call("stop", run=run, grace_s=5)["result"]
    killed = {k["pid"] for k in stop["killed"]}
    check(pids <= killed, f"{run}: every GPU-holding pid was killed ({sorted(pids)} in {sorted(killed)})")
    check(stop["confirmed"] is True and stop["remaining"] == [], f"{run}: stop confirmed, nothing remains")
    check(stop["gpu_released"] is True, f"{run}: stop result says gpu_released true")
    wait_for(lambda: used_mib() < baseline + 512, 30, "GPU memory to drop")
    after = used_mib()
    check(
        after < baseline + 512 and before >= baseline + gib * 1024,
        f"{run}: nvidia-smi memory.used {baseline} MiB at launch, {before} MiB held, {after} MiB after stop",
    )
    sh(SMI_APPS)


def main() -> int:
    """Run the check; write the transcript."""
    parser = argparse.ArgumentParser()
    parser.add_argument("transcript", type=Path)
    parser.add_argument("--gib", type=int, default=20)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[3]
    state = Path(tempfile.mkdtemp(prefix="ew-agent-"))
    say(f"eaglewatch agent GPU check on {socket.gethostname()}; python {sys.version.split()[0]}")
    sh(["nvidia-smi", "--version"])
    sh(SMI_GPU)
    stderr = (state / "daemon.stderr").open("wb")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "agent", "daemon", "--state-dir", str(state)],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
    )
    try:
        sock = state / "agent.sock"
        check(wait_for(sock.exists, 30, "the daemon socket"), "daemon listening")
        client = Client(sock)
        say("hello: " + json.dumps(client.hello))
        gpus = client.call("gpus")["result"]
        check(
            len(gpus["gpus"]) >= 1 and gpus["gpus"][0]["memory_total_mib"] > 100_000,
            f"gpus op sees {len(gpus['gpus'])} GPU(s): {gpus['gpus'][0]['name'] if gpus['gpus'] else None}",
        )
        hold_run(client, state, "gpuhold", [sys.executable, "-c", HOLD, str(args.gib)], args.gib)
        hold_run(client, state, "stubborn", [sys.executable, "-c", STUBBORN, HOLD, str(args.gib)], args.gib)
        say("journal of stubborn:\n" + (state / "runs" / "stubborn" / "events.jsonl").read_text()[-3000:])
        client.call("shutdown")
        check(wait_for(lambda: daemon.poll() is not None, 15, "daemon exit"), "daemon shut down cleanly")
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
        stderr.close()
        say("daemon stderr:\n" + (state / "daemon.stderr").read_text()[-4000:])
        say(f"RESULT: {'ALL CHECKS PASSED' if not FAILURES else 'FAILED: ' + '; '.join(FAILURES)}")
        args.transcript.write_text("\n".join(LOG) + "\n")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
