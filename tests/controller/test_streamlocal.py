"""The direct path to the daemon's socket (a ``direct-streamlocal`` SSH channel) through a real sshd: used
when the server allows it, with the connect bridge gone; the bridge kept when the server forbids it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import agent
from agent import protocol
from agent.spec import parse_spec
from controller import bootstrap
from controller.bootstrap import open_link
from controller.link import Link, SSHTransport
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings
from controller.streamlocal import ROUTE_BRIDGE, ROUTE_DIRECT, go_direct, socket_problem
from tests.controller.conftest import wait_for
from tests.helpers.sshd import SSHD, children_of

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]


@pytest.fixture
def closed_sshd(tmp_path: Path, reap: None) -> Iterator[SSHD]:
    """A real sshd whose config says ``AllowStreamLocalForwarding no``."""
    server = SSHD.start(tmp_path / "sshd", streamlocal=False)
    yield server
    server.stop()


def _host(tmp_path: Path) -> dict[str, Any]:
    return {
        "name": "gpu1",
        "ssh": "eaglehost",
        "python": sys.executable,
        "state_dir": str(tmp_path / "agent"),
    }


def _bridges(sshd: SSHD) -> list[int]:
    """Pids of ``agent connect`` processes running under this sshd's sessions."""
    found, todo = [], [sshd.proc.pid]
    while todo:
        for pid in children_of(todo.pop()):
            todo.append(pid)
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"agent" in cmd and b"connect" in cmd:
                found.append(pid)
    return found


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/srv/eaglewatch/agent/agent.sock", None),
        (None, "did not name its socket"),
        ("", "did not name its socket"),
        (42, "did not name its socket"),
        ("agent.sock", "unusable socket path"),
        ("/tmp/a\0b", "unusable socket path"),
        ("/" + "x" * 200, "unusable socket path"),
    ],
)
def test_socket_path_from_hello_is_checked(path: Any, problem: str | None) -> None:
    found = socket_problem(path)
    assert (found is None) if problem is None else (found is not None and problem in found)


async def test_direct_channel_replaces_the_bridge_when_sshd_allows_it(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings
) -> None:
    streamed: list[dict[str, Any]] = []

    async def on_stream(msg: dict[str, Any]) -> None:
        streamed.append(msg)

    link, fp = await open_link(_host(tmp_path), ssh_settings, on_stream)
    try:
        assert link.route == ROUTE_DIRECT, link.route_reason
        assert link.hello["socket"] == str(tmp_path / "agent" / "agent.sock")
        assert link.transport.describe() == f"ssh-streamlocal:{tmp_path / 'agent' / 'agent.sock'}"
        assert fp  # the host key was verified on the same connection
        await wait_for(_async(lambda: not _bridges(sshd)), 10, what="the bridge process exits")
        spec = {"host": "gpu1", "backend": "command", "command": [sys.executable, "-c", "print('hi')"]}
        await link.request("launch", run="r-direct", spec=spec)
        await link.request("follow", run="r-direct", after_seq=0, log_offset=0)

        def saw_end() -> bool:
            return any(m.get("event", {}).get("state") == "completed" for m in streamed)

        await wait_for(_async(saw_end), 30, what="the job's journal streamed over the direct channel")
        assert any(m.get("type") == "log_block" and m.get("text") == "hi" for m in streamed)
        sshd.kill_sessions()  # dead-link detection: the channel's connection drops
        await wait_for(_async(link.closed.is_set), 15, what="the link noticing the drop")
    finally:
        await link.close()


async def test_bridge_kept_when_sshd_forbids_streamlocal(
    tmp_path: Path, closed_sshd: SSHD, job_script: Path
) -> None:
    settings = Settings(
        home=tmp_path / "home",
        known_hosts=closed_sshd.known_hosts,
        ssh_config=closed_sshd.ssh_config,
        remote_base=str(tmp_path / "remote"),
        reconnect_initial_s=0.1,
        reconnect_max_s=0.5,
        connect_timeout=5,
    )
    stop = tmp_path / "stop"
    async with Controller(settings) as ctl:
        await ctl.add_host(HostCreate(**_host(tmp_path)))
        sup = ctl.supervisors.hosts["gpu1"]
        await sup.connected.wait()
        assert sup.link is not None and sup.link.route == ROUTE_BRIDGE
        assert "refused a direct-streamlocal channel" in sup.link.route_reason
        assert sup.link.transport.describe().startswith("ssh:")
        assert _bridges(closed_sshd)  # the connect bridge carries the link, as before
        host = await ctl.get_host("gpu1")  # and the host's view says which path and why
        assert host.link_route == ROUTE_BRIDGE
        assert host.link_route_reason and "refused a direct-streamlocal channel" in host.link_route_reason
        run_id = await ctl.create_run(
            parse_spec(
                {
                    "host": "gpu1",
                    "backend": "command",
                    "command": [sys.executable, str(job_script), str(stop), "0.05"],
                }
            )
        )

        async def milestones(n: int) -> bool:
            return len((await ctl.get_run(run_id)).milestones) >= n

        await wait_for(lambda: milestones(3), what="milestones over the bridge")
        stop.write_text("")
        await wait_for(lambda: _state(ctl, run_id, "completed"), what="run completed")
        seqs = [m.seq for m in (await ctl.get_run(run_id)).milestones]
        assert seqs == sorted(set(seqs))


async def test_supervisor_reconnects_over_the_direct_channel(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings, job_script: Path
) -> None:
    stop = tmp_path / "stop"
    async with Controller(ssh_settings) as ctl:
        await ctl.add_host(HostCreate(**_host(tmp_path)))
        sup = ctl.supervisors.hosts["gpu1"]
        await sup.connected.wait()
        assert sup.link is not None and sup.link.route == ROUTE_DIRECT
        listed = {h.name: h for h in await ctl.list_hosts()}
        assert (listed["gpu1"].link_route, listed["gpu1"].link_route_reason) == (ROUTE_DIRECT, None)
        run_id = await ctl.create_run(
            parse_spec(
                {
                    "host": "gpu1",
                    "backend": "command",
                    "command": [sys.executable, str(job_script), str(stop), "0.05"],
                }
            )
        )
        await wait_for(lambda: _milestones(ctl, run_id, 3), what="milestones")
        first = sup.link
        sshd.kill_sessions()
        await wait_for(
            _async(lambda: sup.link not in (None, first) and sup.connected.is_set()), what="new link"
        )
        assert sup.link is not None and sup.link.route == ROUTE_DIRECT
        stop.write_text("")
        await wait_for(lambda: _state(ctl, run_id, "completed"), what="run completed")
        seqs = [m.seq for m in (await ctl.get_run(run_id)).milestones]
        assert len(seqs) >= 3 and seqs == sorted(set(seqs))  # replayed exactly once across the reconnect


async def _milestones(ctl: Controller, run_id: str, n: int) -> bool:
    return len((await ctl.get_run(run_id)).milestones) >= n


async def _state(ctl: Controller, run_id: str, state: str) -> bool:
    return (await ctl.get_run(run_id)).state == state


def _async(pred: Any) -> Any:
    async def check() -> bool:
        return bool(pred())

    return check


async def test_bridge_kept_when_another_daemon_answers_on_the_socket(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The channel opens, but what answers there is not the daemon the bridge reached: keep the bridge.

    The bridge's hello is pointed at a second socket, served by a listener that greets with another pid."""
    other = tmp_path / "other.sock"

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(protocol.encode(protocol.hello(agent.__version__, "elsewhere", 1, str(other))))
        await writer.drain()
        await reader.read()
        writer.close()

    async def keep_bridge(name: str, conn: Any, bridge: Link, on_stream: Any) -> Link:
        return bridge

    server = await asyncio.start_unix_server(impostor, path=str(other))
    monkeypatch.setattr(bootstrap, "go_direct", keep_bridge)  # open_link hands back the bridge link
    bridge, _ = await open_link(_host(tmp_path), ssh_settings, None)
    monkeypatch.undo()
    try:
        assert isinstance(bridge.transport, SSHTransport) and bridge.transport.describe().startswith("ssh:")
        bridge.hello["socket"] = str(other)
        link = await go_direct("gpu1", bridge.transport.conn, bridge, None)
        assert link is bridge and link.route == ROUTE_BRIDGE
        assert "another daemon answers" in link.route_reason
        assert (await link.request("version"))[
            "agent_version"
        ] == agent.__version__  # the bridge still serves
        bridge.hello["socket"] = "relative.sock"
        assert await go_direct("gpu1", bridge.transport.conn, bridge, None) is bridge
        assert "unusable socket path" in bridge.route_reason
    finally:
        await bridge.close()
        server.close()
