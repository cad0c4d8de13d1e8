"""The protocol client against real agents and against a deliberately misbehaving one (a subprocess script
standing in for a buggy daemon: the real daemon never sends these lines, which is why a stand-in is used)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from controller.errors import AgentError, Unreachable
from controller.link import Link, LinkClosed, LocalTransport

pytestmark = pytest.mark.timeout(60)

BAD_AGENT = r"""
import json, sys
print(json.dumps({"type": "hello", "agent_version": "0.1.0", "protocol": 1}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    print("this is not json", flush=True)
    sys.stdout.buffer.write(b"\xff\xfe garbage\n"); sys.stdout.flush()
    print(json.dumps({"type": "event", "run": "r-1", "event": {"seq": 1}}), flush=True)
    if req["op"] == "boom":
        print(json.dumps({"type": "error", "id": req["id"], "code": "bad_args", "message": "no"}), flush=True)
    elif req["op"] == "exit":
        sys.exit(0)
    else:
        reply = {"type": "reply", "id": req["id"], "ok": True, "result": {"op": req["op"]}}
        print(json.dumps(reply), flush=True)
"""


async def _spawn(code: str) -> LocalTransport:
    argv = [sys.executable, "-c", code]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    return LocalTransport(proc, argv)


async def test_bad_lines_are_skipped_and_replies_matched() -> None:
    streamed: list[dict[str, Any]] = []

    async def on_stream(msg: dict[str, Any]) -> None:
        streamed.append(msg)

    link = Link(await _spawn(BAD_AGENT), on_stream)
    try:
        assert (await link.start())["agent_version"] == "0.1.0"
        assert await link.request("version") == {"op": "version"}
        with pytest.raises(AgentError, match="bad_args: no"):
            await link.request("boom")
        assert [m["type"] for m in streamed] == ["event", "event"]
        with pytest.raises(LinkClosed):
            await link.request("exit")
        await asyncio.wait_for(link.closed.wait(), 5)
        with pytest.raises(LinkClosed):
            await link.request("version")
    finally:
        await link.close()


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("pass", "exited before saying hello"),
        ("print('hello there', flush=True)", "did not speak the protocol"),
        ("import json; print(json.dumps({'type': 'reply'}), flush=True)", "expected hello"),
    ],
)
async def test_no_hello_is_unreachable(code: str, message: str) -> None:
    link = Link(await _spawn(code))
    with pytest.raises(Unreachable, match=message):
        await link.start()


async def test_real_agent_over_pipes(tmp_path: Path, reap: None) -> None:
    link = Link(await LocalTransport.start(str(tmp_path / "agent")))
    try:
        hello = await link.start()
        assert hello["type"] == "hello" and hello["protocol"] == 1
        assert (await link.request("version"))["agent_version"] == hello["agent_version"]
        with pytest.raises(AgentError) as info:
            await link.request("status", run="r-none")
        assert info.value.agent_code == "not_found"
        with pytest.raises(AgentError) as info:
            await link.request("no_such_op")
        assert info.value.agent_code == "unknown_op"
    finally:
        await link.close()
