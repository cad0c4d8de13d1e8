"""Links to an agent daemon: the JSON-lines protocol client over a transport (SSH channel or local pipes).

``Link`` reads the daemon's hello, then one reader task decodes every line: replies resolve the pending
request with the same id; ``event`` and ``log_block`` stream messages go, in arrival order, to the
``on_stream`` coroutine (a ``log_block``'s raw text, which follows its line, read first: agent/protocol.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from agent import protocol
from controller.errors import AgentError, Unreachable

log = logging.getLogger(__name__)
StreamHandler = Callable[[dict[str, Any]], Awaitable[None]]
#: Largest daemon→controller line accepted (a big reply such as ``read_log``'s; a log block's text follows
#: its line and is read apart).
READ_LIMIT = 64 << 20


class LinkClosed(Unreachable):
    """The link went down while a request was pending (or before it was sent)."""


class Reader(Protocol):
    """What a transport reads from."""

    async def readline(self) -> bytes: ...

    async def readexactly(self, n: int) -> bytes: ...


class Transport(Protocol):
    """A byte-stream pair to ``eaglewatch-agent connect`` on the host."""

    reader: Reader

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    async def close(self) -> None: ...

    def describe(self) -> str: ...


class LocalTransport:
    """``python -m agent connect`` as a local subprocess, spoken to over its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process, argv: list[str]) -> None:
        self.proc = proc
        self.argv = argv
        assert proc.stdout is not None and proc.stdin is not None
        self.reader: Reader = proc.stdout
        self._stdin = proc.stdin

    @classmethod
    async def start(cls, state_dir: str | None = None) -> LocalTransport:
        """Spawn the bridge (which starts the daemon if none is running for ``state_dir``)."""
        argv = [sys.executable, "-m", "agent", "connect"]
        if state_dir:
            argv += ["--state-dir", state_dir]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            limit=READ_LIMIT,
            env=env,
            start_new_session=True,
        )
        return cls(proc, argv)

    def write(self, data: bytes) -> None:
        """Send bytes to the bridge."""
        self._stdin.write(data)

    async def drain(self) -> None:
        """Wait for the pipe to accept more."""
        await self._stdin.drain()

    async def close(self) -> None:
        """Close stdin (the bridge exits), then make sure it is gone."""
        with contextlib.suppress(Exception):
            self._stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 3)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()

    def describe(self) -> str:
        """Human-readable transport name."""
        return "local:" + " ".join(self.argv)


class SSHTransport:
    """A channel of an asyncssh connection: the connect command's session, or a ``direct-streamlocal``
    channel to the daemon's socket (streamlocal.py)."""

    def __init__(
        self, conn: Any, reader: Reader, writer: Any, name: str, owns_connection: bool = True
    ) -> None:
        self.conn = conn
        self.reader = reader
        self._writer = writer
        self.name = name
        #: Whether closing this transport closes the connection too (a direct channel once the bridge has
        #: handed the connection on).
        self.owns_connection = owns_connection

    def write(self, data: bytes) -> None:
        """Send bytes over the channel."""
        self._writer.write(data)

    async def drain(self) -> None:
        """Wait for the channel window."""
        await self._writer.drain()

    async def close_channel(self) -> None:
        """Close this channel only (a bridge exits), keeping the connection for another channel."""
        with contextlib.suppress(Exception):
            self._writer.write_eof()
        with contextlib.suppress(Exception):
            self._writer.close()

    async def close(self) -> None:
        """Close the channel and, when it owns it, the connection (jobs and the daemon keep running)."""
        await self.close_channel()
        if self.owns_connection:
            self.conn.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.conn.wait_closed(), 3)

    def describe(self) -> str:
        """Human-readable transport name."""
        return self.name


class Link:
    """Protocol client: requests with ids, replies matched, stream messages handed on in order."""

    def __init__(self, transport: Transport, on_stream: StreamHandler | None = None) -> None:
        self.transport = transport
        self.on_stream = on_stream
        self.hello: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader_task: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()
        self.close_reason = ""
        self._write_lock = asyncio.Lock()
        #: Which path reaches the daemon (controller/streamlocal.py ROUTE_*), and why not a shorter one.
        self.route = ""
        self.route_reason = ""

    async def start(self, timeout: float = 30.0) -> dict[str, Any]:
        """Read the daemon's hello and start the reader task; returns the hello."""
        try:
            line = await asyncio.wait_for(self.transport.reader.readline(), timeout)
        except TimeoutError:
            await self.transport.close()
            raise Unreachable(
                f"no hello from agent within {timeout:.0f}s ({self.transport.describe()})"
            ) from None
        except Exception as exc:  # the transport died (asyncssh.ConnectionLost, BrokenPipe…)
            await self.transport.close()
            raise LinkClosed(f"link dropped before hello: {type(exc).__name__}: {exc}") from None
        if not line:
            await self.transport.close()
            raise Unreachable(f"agent bridge exited before saying hello ({self.transport.describe()})")
        try:
            msg = protocol.decode_message(line)
        except protocol.ProtocolError as exc:
            await self.transport.close()
            raise Unreachable(
                f"agent bridge did not speak the protocol: {exc.message}: {line[:200]!r}"
            ) from None
        if msg.get("type") != "hello":
            await self.transport.close()
            raise Unreachable(f"expected hello from agent, got {msg.get('type')!r}")
        self.hello = msg
        self._reader_task = asyncio.create_task(self._read_loop(), name="link-reader")
        return msg

    async def request(self, op: str, timeout: float | None = 60.0, **args: Any) -> dict[str, Any]:
        """Send one request; returns its result, raises AgentError for an error reply, LinkClosed if down."""
        if self.closed.is_set():
            raise LinkClosed(f"link is down: {self.close_reason}")
        req_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            async with self._write_lock:
                self.transport.write(protocol.encode({"id": req_id, "op": op, **args}))
                await self.transport.drain()
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise Unreachable(f"agent did not answer {op!r} within {timeout}s") from None
        except (ConnectionError, OSError) as exc:
            raise LinkClosed(f"link is down: {exc}") from None
        except Exception as exc:
            if isinstance(exc, (AgentError, Unreachable)):
                raise
            raise LinkClosed(f"link is down: {type(exc).__name__}: {exc}") from None
        finally:
            self._pending.pop(req_id, None)

    async def _read_loop(self) -> None:
        try:
            while True:
                line = await self.transport.reader.readline()
                if not line:
                    self.close_reason = "agent closed the connection"
                    break
                try:
                    msg = protocol.decode_message(line)
                except protocol.ProtocolError as exc:
                    log.warning("link: ignoring bad line from agent: %s", exc.message)
                    continue
                size = protocol.payload_size(msg)  # a bad size desynchronises the stream: the link ends
                if size is not None:
                    msg = protocol.attach_payload(msg, await self.transport.reader.readexactly(size))
                mtype = msg.get("type")
                if mtype in ("reply", "error"):
                    fut = self._pending.get(msg.get("id"))  # type: ignore[arg-type]
                    if fut is None or fut.done():
                        continue
                    if mtype == "reply":
                        fut.set_result(msg.get("result") or {})
                    else:
                        fut.set_exception(AgentError(str(msg.get("code")), str(msg.get("message"))))
                elif self.on_stream is not None:
                    await self.on_stream(msg)
        except asyncio.CancelledError:
            self.close_reason = "closed"
            raise
        except Exception as exc:
            self.close_reason = f"{type(exc).__name__}: {exc}"
            log.debug("link reader ended", exc_info=True)
        finally:
            self.closed.set()
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(LinkClosed(f"link went down: {self.close_reason}"))

    async def stop_reading(self) -> None:
        """Stop the reader task, leaving the transport open (a link handing its connection on)."""
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task

    async def close(self) -> None:
        """Close the transport and stop reading."""
        await self.stop_reading()
        await self.transport.close()
        self.closed.set()
