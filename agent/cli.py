"""``eaglewatch-agent``: daemon, connect, launch here; milestones, check, extract, tiny-model... delegated."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import secrets
import sys
import time
from pathlib import Path

from agent import __version__, settings
from agent.paths import valid_run_id

#: Sub-commands implemented in other modules: name → (module, function taking argv).  Imported only when used.
DELEGATED = {
    "milestones": ("agent.milestones.cli", "run"),
    "check": ("agent.checks.cli", "run"),
    "extract": ("agent.extract.cli", "run_extract"),
    "tiny-model": ("agent.extract.tinymodel", "main"),
    "merge-manifests": ("agent.extract.writing.shards", "run"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eaglewatch-agent", description="eaglewatch agent for a GPU host")
    p.add_argument("--version", action="version", version=f"eaglewatch-agent {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser("daemon", help="run the host daemon (systemd runs this)")
    d.add_argument(
        "--state-dir", type=Path, help=f"default ${settings.AGENT_HOME.name} or {settings.AGENT_HOME.default}"
    )
    d.add_argument("--socket", type=Path, help="default <state dir>/agent.sock")
    d.add_argument("--poll", action="store_true", help="poll the run dirs instead of using inotify")
    d.add_argument(
        "--lock-wait-s", type=float, default=10.0, help="wait this long for a stopping daemon (default 10)"
    )
    d.add_argument("-v", "--verbose", action="store_true")
    c = sub.add_parser("connect", help="bridge stdin/stdout to the daemon (starts it if needed)")
    c.add_argument("--state-dir", type=Path)
    c.add_argument("--socket", type=Path)
    la = sub.add_parser("launch", help="launch a run from a spec file through the daemon")
    la.add_argument("--spec", type=Path, required=True, help="run spec JSON file")
    la.add_argument("--run", help="run id (default: <spec name>-<time>-<random>)")
    la.add_argument("--state-dir", type=Path)
    la.add_argument("--socket", type=Path)
    for name in DELEGATED:
        sub.add_parser(name, help=f"see `eaglewatch-agent {name} --help`", add_help=False)
    return p


def _dirs(args: argparse.Namespace) -> tuple[Path, Path]:
    state = args.state_dir or settings.AGENT_HOME.get()
    return state, args.socket or state / "agent.sock"


def new_run_id(name: str) -> str:
    """A fresh run id from a spec name: ``<name>-<UTC time>-<4 hex>``."""
    base = name if valid_run_id(name) else "run"
    return f"{base[:40]}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def _launch(args: argparse.Namespace) -> int:
    from agent.daemon.bridge import ensure_daemon
    from agent.protocol import decode_message, encode

    try:
        spec = json.loads(args.spec.read_text())
    except (OSError, ValueError) as exc:
        print(f"eaglewatch-agent launch: cannot read spec {args.spec}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(spec, dict):
        print(f"eaglewatch-agent launch: spec {args.spec} must hold a JSON object", file=sys.stderr)
        return 2
    run = args.run or new_run_id(str(spec.get("name", "run")))
    if not valid_run_id(run):
        print(f"eaglewatch-agent launch: bad run id {run!r}", file=sys.stderr)
        return 2
    state, sock_path = _dirs(args)
    try:
        sock = ensure_daemon(state, sock_path)
    except ConnectionError as exc:
        print(f"eaglewatch-agent launch: {exc}", file=sys.stderr)
        return 1
    with sock, sock.makefile("rwb") as f:
        f.readline()  # hello
        f.write(encode({"id": 1, "op": "launch", "run": run, "spec": spec}))
        f.flush()
        msg = decode_message(f.readline())
    print(json.dumps(msg))
    return 0 if msg.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``eaglewatch-agent`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        module, func = DELEGATED[argv[0]]
        try:
            fn = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as exc:
            print(f"eaglewatch-agent {argv[0]}: not available on this host ({exc})", file=sys.stderr)
            return 2
        return int(fn(argv[1:]))
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help(sys.stderr)
        return 2
    if args.command == "daemon":
        import faulthandler
        import signal

        from agent.daemon.server import run_daemon

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps stacks to the log

        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(message)s",
        )
        return asyncio.run(run_daemon(*_dirs(args), args.lock_wait_s, not args.poll))
    if args.command == "connect":
        from agent.daemon.bridge import run_connect

        return run_connect(*_dirs(args))
    return _launch(args)
