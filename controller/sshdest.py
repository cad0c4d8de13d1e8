"""SSH destinations: parse ``[ssh://][user@]host[:port]`` (pure)."""

from __future__ import annotations


def parse_destination(dest: str) -> tuple[str, int | None, str | None]:
    """Split ``[ssh://][user@]host[:port]`` (IPv6 in brackets) into (host, port, user).

    An ``~/.ssh/config`` alias is just a host here; asyncssh applies the config's HostName/Port/User to it.
    Raises ValueError naming what is wrong.
    """
    rest = dest.removeprefix("ssh://")
    user, sep, hostport = rest.rpartition("@")
    if not sep:
        user, hostport = "", rest
    port: int | None = None
    if hostport.startswith("["):
        host, _, tail = hostport[1:].partition("]")
        if tail.startswith(":") and tail[1:].isdigit():
            port = int(tail[1:])
    else:
        host, colon, tail = hostport.partition(":")
        if colon:
            if not tail.isdigit() or not 0 < int(tail) < 65536:
                raise ValueError(f"bad port in ssh destination {dest!r}")
            port = int(tail)
    if not host:
        raise ValueError(f"no host in ssh destination {dest!r}")
    return host, port, user or None
