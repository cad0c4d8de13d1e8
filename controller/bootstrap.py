"""Open a link to a host's agent: SSH connect (verified host keys), upload the agent over an exec channel,
run connect, then go straight to the daemon's socket where sshd allows it (streamlocal.py).

The agent core is stdlib-only, so it runs under the host's own Python straight from the uploaded package:
``<home>/.local/share/eaglewatch/agent-<version>-<digest>/agent``; the command is built with ``shlex.join``
over an argv list only.  A daemon reporting another version in its hello is sent ``shutdown`` (its jobs are
detached and keep running) and the connect is retried, which starts the new daemon.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
from functools import cache
from pathlib import Path
from typing import Any

import agent
from controller.errors import HostKeyRejected, Unreachable
from controller.link import Link, LocalTransport, SSHTransport, StreamHandler
from controller.models import parse_destination
from controller.settings import Settings
from controller.streamlocal import ROUTE_LOCAL, go_direct

log = logging.getLogger(__name__)
AGENT_DIR = Path(agent.__file__).resolve().parent
LOCAL_DEST = "local"


@cache
def agent_files() -> tuple[tuple[str, bytes], ...]:
    """(relative path, content) of every file of the agent package that is shipped to hosts."""
    out = []
    for path in sorted(AGENT_DIR.rglob("*")):
        rel = path.relative_to(AGENT_DIR)
        if path.is_file() and "__pycache__" not in rel.parts and path.suffix in (".py", ".toml", ".json"):
            out.append((rel.as_posix(), path.read_bytes()))
    return tuple(out)


def is_older(version: str, than: str) -> bool:
    """True when dotted ``version`` sorts before ``than`` (numeric parts; unparsable counts as older)."""

    def key(v: str) -> tuple[int, ...]:
        parts = []
        for p in v.split("."):
            digits = p[: len(p) - len(p.lstrip("0123456789"))]  # the leading number: "0rc1" -> 0
            parts.append(int(digits) if digits else -1)
        return tuple(parts)

    if not version:
        return True
    return key(version) < key(than)


def agent_digest() -> str:
    """Short digest of the shipped files: a changed agent gets a new directory on the host."""
    h = hashlib.sha256()
    for rel, data in agent_files():
        h.update(rel.encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:10]


def _target(dest: str) -> dict[str, Any]:
    host, port, user = parse_destination(dest)
    target: dict[str, Any] = {"host": host}
    if port is not None:
        target["port"] = port
    if user is not None:
        target["username"] = user
    return target


def fingerprint(key: Any) -> str:
    """SHA256 fingerprint of an asyncssh public key."""
    return str(key.get_fingerprint("sha256"))


async def fetch_host_key(dest: str, settings: Settings) -> str:
    """The fingerprint the host presents, fetched without trusting it (for ``hosts add``)."""
    import asyncssh

    target = _target(dest)
    opts = settings.ssh_options()
    try:
        key = await asyncssh.get_server_host_key(
            target["host"], target.get("port", ()), config=opts.get("config", ())
        )
    except (OSError, asyncssh.Error) as exc:
        raise Unreachable(f"cannot reach {dest}: {exc}") from None
    if key is None:
        raise Unreachable(f"{dest} presented no host key")
    return fingerprint(key)


async def ssh_connect(name: str, dest: str, settings: Settings) -> Any:
    """An asyncssh connection with verified host key; HostKeyRejected when known_hosts does not trust it."""
    import asyncssh

    try:
        return await asyncssh.connect(**_target(dest), **settings.ssh_options())
    except asyncssh.HostKeyNotVerifiable as exc:
        try:
            fp: str | None = await fetch_host_key(dest, settings)
        except Exception:
            fp = None
        hint = (
            f" (it presents {fp}; if that is expected, add it with: ssh-keyscan to known_hosts)" if fp else ""
        )
        raise HostKeyRejected(f"host {name}: {exc}{hint}", fp) from None
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        raise Unreachable(f"host {name}: cannot connect to {dest}: {type(exc).__name__}: {exc}") from None


#: The fixed program that receives the agent over an exec channel: run by the host's own Python, only its argv
#: items vary (``shlex.join`` quotes them).  ``check`` prints ``present`` or ``absent`` and the absolute
#: target; ``write`` reads a JSON header line ``{"files": [[relative path, size], ...]}`` then the files'
#: bytes back to back, and renames a temporary directory into place with a ``.complete`` marker.
RECEIVER = r"""
import json, os, shutil, sys, uuid
mode, base, name = sys.argv[1], os.path.expanduser(sys.argv[2]), sys.argv[3]
if "/" in name or name in ("", ".", ".."):
    sys.exit("bad directory name")
target = os.path.abspath(os.path.join(base, name))
if mode == "check":
    print(("present " if os.path.exists(os.path.join(target, ".complete")) else "absent ") + target)
    sys.exit(0)
src = sys.stdin.buffer
files = json.loads(src.readline())["files"]
tmp = target + ".tmp-" + uuid.uuid4().hex[:8]
for rel, size in files:
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        sys.exit("bad path in upload: %r" % rel)
    path = os.path.join(tmp, "agent", *parts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = src.read(size)
    if len(data) != size:
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit("upload cut short at %s" % rel)
    with open(path, "wb") as f:
        f.write(data)
with open(os.path.join(tmp, ".complete"), "wb") as f:
    f.write(b"ok\n")
try:
    os.rename(tmp, target)
except OSError:
    # another controller uploaded the same version meanwhile; theirs is as good as ours
    shutil.rmtree(tmp, ignore_errors=True)
    if not os.path.exists(os.path.join(target, ".complete")):
        raise
print(target)
"""


async def ensure_agent(conn: Any, remote_base: str, python: str) -> str:
    """Upload the agent package through ``RECEIVER`` unless this version is already there; returns the
    remote PYTHONPATH.  An exec channel works on every host, with or without an sftp subsystem."""

    def tail(text: str | bytes | None) -> str:
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        return (text or "").strip()[-500:] or "no message"

    name = f"agent-{agent.__version__}-{agent_digest()}"
    check = await conn.run(shlex.join([python, "-c", RECEIVER, "check", remote_base, name]), check=False)
    if check.exit_status != 0:
        raise Unreachable(f"cannot run {python} on the host to receive the agent: {tail(check.stderr)}")
    state, _, target = str(check.stdout).strip().partition(" ")
    if state == "present":
        return target
    files = agent_files()
    header = json.dumps({"files": [[rel, len(data)] for rel, data in files]}).encode() + b"\n"
    res = await conn.run(
        shlex.join([python, "-c", RECEIVER, "write", remote_base, name]),
        input=header + b"".join(data for _, data in files),
        encoding=None,
        check=False,
    )
    if res.exit_status != 0:
        raise Unreachable(f"uploading the agent over an exec channel failed: {tail(res.stderr)}")
    log.info("uploaded agent to %s", target)
    return res.stdout.decode().strip() or target


async def open_link(
    host: dict[str, Any], settings: Settings, on_stream: StreamHandler | None
) -> tuple[Link, str | None]:
    """Connect to ``host`` (a hosts row), bootstrap the agent, return (started Link, host key fingerprint)."""
    for attempt in range(2):
        conn: Any = None
        if host["ssh"] == LOCAL_DEST:
            link = Link(await LocalTransport.start(host.get("state_dir")), on_stream)
            link.route = ROUTE_LOCAL
            fp = None
        else:
            conn = await ssh_connect(host["name"], host["ssh"], settings)
            fp = fingerprint(conn.get_server_host_key())
            try:
                pythonpath = await ensure_agent(conn, settings.remote_base, host["python"])
                argv = ["env", f"PYTHONPATH={pythonpath}", host["python"], "-m", "agent", "connect"]
                if host.get("state_dir"):
                    argv += ["--state-dir", host["state_dir"]]
                command = shlex.join(argv)
                process = await conn.create_process(command, encoding=None)
            except Exception as exc:
                conn.close()
                raise Unreachable(
                    f"host {host['name']}: bootstrap failed: {type(exc).__name__}: {exc}"
                ) from None
            link = Link(SSHTransport(conn, process.stdout, process.stdin, f"ssh:{command}"), on_stream)
        hello = await link.start()
        if attempt == 1 or not is_older(str(hello.get("agent_version", "")), agent.__version__):
            if conn is not None:  # the bridge started the daemon; now skip it where sshd allows
                link = await go_direct(host["name"], conn, link, on_stream)
            return link, fp
        # An older daemon: ask it to exit, leaving its jobs running; the next connect starts ours.
        log.info(
            "host %s runs agent %s, upgrading to %s",
            host["name"],
            hello.get("agent_version"),
            agent.__version__,
        )
        try:
            await link.request("shutdown", timeout=10)
        finally:
            await link.close()
    raise AssertionError("unreachable")
