"""Catch a host's runs up from its agent's journal once, for processes that do not supervise (the CLI).

Without ``serve`` nothing follows a run after ``runs start``: the database keeps what it held at launch.
``refresh_host`` opens a one-shot link, does what a supervisor does on connect (``catch_up_once``: the
same ``follow`` from the stored seq and log offset, the same ingest path), waits until the store holds
everything the agent's ``status`` reported, and closes the link.  A host that cannot be reached within
the timeout is reported with the error and when it was last heard; nothing is marked unreachable, since a
running ``serve`` may well have a good link of its own.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from controller import queries
from controller.alerts import AlertPolicy
from controller.bootstrap import open_link
from controller.errors import AgentError, ControllerError, NotFound
from controller.link import Link
from controller.settings import Settings
from controller.store import Store
from controller.supervisor import HostSupervisor

#: How long a CLI command waits for one host before answering from what is stored.
REFRESH_TIMEOUT_S = 15.0
#: Journal caught up and the log offset unchanged this long: the rest is a line still being written.
LOG_SETTLE_S = 1.0


@dataclass(frozen=True)
class Freshness:
    """Whether a host's runs were caught up just now; if not, why, and when it was last heard."""

    host: str
    ok: bool
    error: str | None = None
    last_seen: float | None = None

    def describe(self, now: float | None = None) -> str:
        """One plain sentence for a user (empty when the host answered)."""
        if self.ok:
            return ""
        heard = "never heard from"
        if self.last_seen is not None:
            ago = max(0.0, (now or time.time()) - self.last_seen)
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.last_seen))
            heard = f"last heard {_ago(ago)} ago ({when})"
        return f"host {self.host}: not reachable now ({self.error}); {heard}: showing what was stored then"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


async def refresh_host(
    name: str, settings: Settings, store: Store, policy: AlertPolicy, timeout: float = REFRESH_TIMEOUT_S
) -> Freshness:
    """Bring ``name``'s runs up to date from its agent within ``timeout`` seconds."""
    sup = HostSupervisor(name, settings, store, policy)
    link: Link | None = None
    try:
        async with asyncio.timeout(timeout):
            host = await store.read(queries.host_row, name)
            link, fp = await open_link(host, settings, sup.on_stream)
            await sup.connected_to(link, fp)
            await sup.catch_up_once(link)
            await _wait_caught_up(sup, link)
    except TimeoutError:
        return await _stale(store, name, f"no complete answer within {timeout:.0f} s")
    except ControllerError as exc:
        return await _stale(store, name, exc.message)
    except OSError as exc:
        return await _stale(store, name, f"{type(exc).__name__}: {exc}")
    finally:
        if link is not None:
            await link.close()
    return Freshness(name, True)


async def _wait_caught_up(sup: HostSupervisor, link: Link) -> None:
    """Wait until every followed run's stored seq and log offset reach what the agent reports now."""
    for run_id in sorted(sup.following):
        try:
            status = await link.request("status", run=run_id, timeout=10)
        except AgentError:
            continue
        want_seq, want_log = int(status.get("last_seq") or 0), int(status.get("log_size") or 0)
        last_offset, still_since = -1, time.monotonic()
        while True:
            row = await sup.store.read(queries.run_row, run_id)
            if row["last_seq"] >= want_seq:
                if row["log_offset"] >= want_log:
                    break
                # An unterminated last line is held back by the agent, so the offset may stop short.
                if row["log_offset"] != last_offset:
                    last_offset, still_since = row["log_offset"], time.monotonic()
                elif time.monotonic() - still_since > LOG_SETTLE_S:
                    break
            if link.closed.is_set():
                raise ControllerError(f"link closed while catching up: {link.close_reason}")
            await asyncio.sleep(0.05)


async def _stale(store: Store, name: str, error: str) -> Freshness:
    try:
        host = await store.read(queries.host_row, name)
    except NotFound:
        return Freshness(name, False, error)
    return Freshness(name, False, error, host.get("last_seen"))
