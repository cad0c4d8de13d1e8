"""The direct SSH path to the agent daemon: a ``direct-streamlocal@openssh.com`` channel to its Unix socket.

``open_link`` (bootstrap.py) first runs ``eaglewatch-agent connect``, which starts the daemon when none runs;
the daemon's hello names its socket.  ``go_direct`` then opens a channel straight to it, checks that the same
daemon answers, and closes the bridge channel: the ``connect`` process, one copy and two process hand-offs
per message, leave the steady-state path.  Where sshd refuses (``AllowStreamLocalForwarding no``,
``DisableForwarding yes``), the agent names no socket or another daemon answers, the bridge stays.
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any

from controller.errors import Unreachable
from controller.link import Link, SSHTransport, StreamHandler

log = logging.getLogger(__name__)
#: ``Link.route`` values.
ROUTE_DIRECT = "direct-streamlocal"
ROUTE_BRIDGE = "connect-bridge"
ROUTE_LOCAL = "local-pipes"
#: Longest socket path accepted from a hello (sun_path is 108 bytes on Linux).
MAX_SOCKET_PATH = 108


def socket_problem(path: Any) -> str | None:
    """Why ``path`` (a hello's ``socket``) cannot be used for a direct channel, or None when it can."""
    if not isinstance(path, str) or not path:
        return "the agent did not name its socket (an older agent)"
    too_long = len(path.encode("utf-8", "surrogateescape")) > MAX_SOCKET_PATH
    if not posixpath.isabs(path) or "\0" in path or too_long:
        return f"the agent named an unusable socket path {path!r}"
    return None


async def go_direct(name: str, conn: Any, bridge: Link, on_stream: StreamHandler | None) -> Link:
    """A started Link over a direct channel to the daemon that greeted ``bridge``, whose channel is then
    closed, leaving ``conn`` to the new link; ``bridge`` itself when the server refuses the channel or it
    leads elsewhere."""
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
    if problem is None:
        transport = SSHTransport(conn, reader, writer, f"ssh-streamlocal:{path}", owns_connection=False)
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
    if problem is not None:
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
