"""Upload the agent over a plain exec channel, for hosts whose sshd offers no ``sftp`` subsystem.

The host runs one fixed Python program (``RECEIVER``) with the host's own Python; only argv items that
``shlex.join`` quotes vary (the Python path, the base directory, the directory name), never a shell
string built from them.  ``check`` prints ``present`` or ``absent`` and the absolute target; ``write``
reads a JSON header line ``{"files": [[relative path, size], ...]}`` and then the files' bytes back to
back from stdin, writes them into a temporary directory beside the target and renames it into place (the
same ``.complete`` marker as the SFTP upload), so a half-sent upload is never taken for a complete one.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from controller.errors import Unreachable

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


def receiver_command(python: str, mode: str, base: str, name: str) -> str:
    """The command line run on the host: the fixed receiver with quoted argv items."""
    return shlex.join([python, "-c", RECEIVER, mode, base, name])


def pack(files: tuple[tuple[str, bytes], ...]) -> bytes:
    """The receiver's stdin: a JSON header line, then every file's bytes in order."""
    header = json.dumps({"files": [[rel, len(data)] for rel, data in files]}).encode() + b"\n"
    return header + b"".join(data for _, data in files)


async def upload_over_exec(
    conn: Any, python: str, base: str, name: str, files: tuple[tuple[str, bytes], ...]
) -> str:
    """Make sure ``<base>/<name>`` holds ``files`` under ``agent/``; returns that directory on the host."""
    check = await conn.run(receiver_command(python, "check", base, name), check=False)
    if check.exit_status != 0:
        raise Unreachable(f"cannot run {python} on the host to receive the agent: {_tail(check.stderr)}")
    state, _, target = str(check.stdout).strip().partition(" ")
    if state == "present":
        return target
    res = await conn.run(
        receiver_command(python, "write", base, name), input=pack(files), encoding=None, check=False
    )
    if res.exit_status != 0:
        raise Unreachable(f"uploading the agent over an exec channel failed: {_tail(res.stderr)}")
    return res.stdout.decode().strip() or target


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "").strip()[-500:] or "no message"
