"""The direct SSH path to the agent daemon: a ``direct-streamlocal@openssh.com`` channel to its Unix socket.

How it works
------------
``open_link`` (bootstrap.py) first runs ``eaglewatch-agent connect`` as always: it starts the daemon when
none runs, and the daemon's hello names its socket (an absolute path, agent/protocol.py).  ``go_direct``
then asks the host's sshd for a channel straight to that socket (OpenSSH allows it unless
``AllowStreamLocalForwarding no`` or ``DisableForwarding yes``), checks that the same daemon answers there,
and closes the bridge channel: the ``connect`` process, one copy and two process hand-offs per message,
leave the steady-state path.  Whenever the server refuses the channel (or the agent names no socket, or
another daemon answers) the bridge link is kept, working exactly as before.  The SSH connection, its
verified host key and keepalives are the same in both cases; ``Link.route`` says which path is in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
from typing import Any

from controller.errors import Unreachable
from controller.link import Link, Reader, SSHTransport, StreamHandler

log = logging.getLogger(__name__)
#: ``Link.route`` values.
ROUTE_DIRECT = "direct-streamlocal"
ROUTE_BRIDGE = "connect-bridge"
ROUTE_LOCAL = "local-pipes"
#: Longest socket path accepted from a hello (sun_path is 108 bytes on Linux).
MAX_SOCKET_PATH = 108


class StreamLocalTransport:
    """A ``direct-streamlocal`` channel to the daemon's socket over an existing asyncssh connection."""

    def __init__(self, conn: Any, reader: Any, writer: Any, socket_path: str) -> None:
        self.conn = conn
        self.reader: Reader = reader
        self._writer = writer
        self.socket_path = socket_path
        #: Whether closing this transport closes the connection too (once the bridge has handed it on).
        self.owns_connection = False

    def write(self, data: bytes) -> None:
        """Send bytes over the channel."""
        self._writer.write(data)

    async def drain(self) -> None:
        """Wait for the channel window."""
        await self._writer.drain()

    async def close(self) -> None:
        """Close the channel and, once it owns it, the connection (jobs and the daemon keep running)."""
        with contextlib.suppress(Exception):
            self._writer.write_eof()
        with contextlib.suppress(Exception):
            self._writer.close()
        if not self.owns_connection:
            return
        self.conn.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.wait_closed(), 3)

    def describe(self) -> str:
        """Human-readable transport name."""
        return f"ssh-streamlocal:{self.socket_path}"


def socket_problem(path: Any) -> str | None:
    """Why ``path`` (a hello's ``socket``) cannot be used for a direct channel, or None when it can."""
    if not isinstance(path, str) or not path:
        return "the agent did not name its socket (an older agent)"
    too_long = len(path.encode("utf-8", "surrogateescape")) > MAX_SOCKET_PATH
    if not posixpath.isabs(path) or "\0" in path or too_long:
        return f"the agent named an unusable socket path {path!r}"
    return None


async def go_direct(name: str, conn: Any, bridge: Link, on_stream: StreamHandler | None) -> Link:
    """A started Link over a direct channel to the daemon that greeted ``bridge``; ``bridge`` when the
    server refuses the channel or it leads elsewhere (then the bridge stays the path, as before).

    On success the bridge's channel is closed, leaving ``conn`` to the new link.
    """
    import asyncssh

    path = bridge.hello.get("socket")
    problem = socket_problem(path)
    if problem is None:
        try:
            reader, writer = await conn.open_unix_connection(path)
        except asyncssh.ChannelOpenError as exc:
            problem = f"the SSH server refused a direct-streamlocal channel ({exc.reason})"
        except (OSError, asyncssh.Error) as exc:
            problem = f"the direct-streamlocal channel failed: {type(exc).__name__}: {exc}"
    if problem is not None:
        log.info("host %s: link via the connect bridge: %s", name, problem)
        bridge.route = ROUTE_BRIDGE
        bridge.route_reason = problem
        return bridge
    transport = StreamLocalTransport(conn, reader, writer, str(path))
    direct = Link(transport, on_stream)
    try:
        hello: dict[str, Any] = await direct.start(timeout=15)
    except Unreachable as exc:  # start() closed the channel only: the bridge carries on
        hello = {"error": exc.message}
    if hello.get("pid") != bridge.hello.get("pid"):
        # No hello, or another daemon (a restart in between): the bridge's passed the version check.
        await direct.close()
        problem = hello.get("error") or (
            f"another daemon answers on {path} (pid {hello.get('pid')}, not {bridge.hello.get('pid')})"
        )
        log.info("host %s: link via the connect bridge: %s", name, problem)
        bridge.route, bridge.route_reason = ROUTE_BRIDGE, str(problem)
        return bridge
    transport.owns_connection = True
    await bridge.stop_reading()
    if isinstance(bridge.transport, SSHTransport):
        await bridge.transport.close_channel()
    direct.route = ROUTE_DIRECT
    log.info("host %s: link via a direct-streamlocal channel to %s", name, path)
    return direct
