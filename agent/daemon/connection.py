"""One client connection of the daemon: read request lines (bounded), dispatch ops, stream follows."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import __version__, protocol
from agent.backends import Backend
from agent.checks.child import check_file
from agent.daemon.launch_paths import path_error
from agent.daemon.streams import stream_events, stream_log
from agent.jobs import attached
from agent.jobs import control as jobs
from agent.logs.tail import read_from
from agent.protocol import ErrorCode, Op, ProtocolError, Request
from agent.runs.jobspec import JobSpec, SpecError
from agent.runs.output_info import ForecastError, ManifestError, forecast, read_manifest

if TYPE_CHECKING:
    from agent.daemon.server import Daemon

log = logging.getLogger("eaglewatch.agent")
#: Ops that may take seconds: they run in their own task so the connection keeps answering.
SLOW_OPS = frozenset({Op.LAUNCH, Op.STOP, Op.CHECK, Op.GPUS, Op.FORECAST})
MAX_IN_FLIGHT = 16


def _int_arg(args: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(ErrorCode.BAD_ARGS, f"'{name}' must be an integer in [{lo}, {hi}]")
    return value


class Connection:
    """Serves one client until it disconnects."""

    def __init__(self, daemon: Daemon, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.daemon = daemon
        self.reader = reader
        self.writer = writer
        self.follows: dict[str, list[asyncio.Task[None]]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def send(self, message: dict[str, Any]) -> None:
        """Write one message; raises ConnectionResetError once the client is gone."""
        await self.send_bytes(protocol.encode(message))

    async def send_bytes(self, data: bytes) -> None:
        """Write encoded messages; raises ConnectionResetError once the client is gone."""
        if self.writer.is_closing():
            raise ConnectionResetError("client went away")
        self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        """End every stream of this connection and close it."""
        for task in [t for ts in self.follows.values() for t in ts] + list(self.tasks):
            task.cancel()
        self.writer.close()

    async def serve(self) -> None:
        """Say hello, then answer request lines until EOF."""
        try:
            await self.send(
                protocol.hello(__version__, self.daemon.hostname, os.getpid(), str(self.daemon.socket_path))
            )
            while True:
                line = await self._read_line()
                if line is None:
                    break
                if not line.strip():
                    continue
                await self._dispatch(line)
            if self.tasks:  # answer what is in flight before hanging up
                await asyncio.gather(*self.tasks, return_exceptions=True)
        except (ConnectionError, BrokenPipeError):
            pass
        finally:
            self.close()

    async def _read_line(self) -> bytes | None:
        """The next request line; an over-long one is discarded chunk by chunk and answered ``too_long``."""
        try:
            return await self.reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            return exc.partial or None
        except asyncio.LimitOverrunError as exc:
            dropped = len(await self.reader.read(exc.consumed))
            while True:
                try:
                    dropped += len(await self.reader.readuntil(b"\n"))
                    break
                except asyncio.LimitOverrunError as more:
                    dropped += len(await self.reader.read(more.consumed))
                except asyncio.IncompleteReadError as end:
                    dropped += len(end.partial)
                    break
            await self.send(
                protocol.error(
                    None,
                    ErrorCode.TOO_LONG,
                    f"request line of {dropped} bytes exceeds {protocol.MAX_LINE_BYTES}; discarded",
                )
            )
            return b""

    async def _dispatch(self, line: bytes) -> None:
        try:
            req = protocol.decode_request(line)
        except ProtocolError as exc:
            await self.send(protocol.error(exc.request_id, exc.code, exc.message))
            return
        if req.op in SLOW_OPS:
            await self._slots.acquire()
            task = asyncio.get_running_loop().create_task(self._answer(req))
            self.tasks.add(task)
            task.add_done_callback(self._task_done)
        else:
            await self._answer(req)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._slots.release()

    async def _answer(self, req: Request) -> None:
        try:
            result = await getattr(self, f"op_{req.op.value}")(req.args)
        except ProtocolError as exc:
            await self.send(protocol.error(req.id, exc.code, exc.message))
            return
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("op %s failed", req.op.value)
            await self.send(protocol.error(req.id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            return
        if req.op is Op.SHUTDOWN:
            self.daemon.request_shutdown()  # before the reply: a client that hangs up at once still stops us
        await self.send(protocol.reply(req.id, result))
        if req.op is Op.FOLLOW:
            self._start_follow(req.args)

    # --- ops -------------------------------------------------------------------------------------
    async def op_version(self, args: dict[str, Any]) -> dict[str, Any]:
        """Agent and protocol versions."""
        return {
            "agent_version": __version__,
            "protocol": protocol.PROTOCOL_VERSION,
            "python": platform.python_version(),
            "hostname": self.daemon.hostname,
        }

    async def op_launch(self, args: dict[str, Any]) -> dict[str, Any]:
        """Start a run."""
        return await self.daemon.launch(args["run"], args["spec"], args.get("scheduler"))

    async def op_stop(self, args: dict[str, Any]) -> dict[str, Any]:
        """Stop a run: SIGTERM, grace, SIGKILL, confirm; wait briefly for its final state."""
        watcher = self.daemon.watcher(args)
        grace = args.get("grace_s", 10)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace <= 3600:
            raise ProtocolError(ErrorCode.BAD_ARGS, "'grace_s' must be a number of seconds in [0, 3600]")
        result = await asyncio.to_thread(jobs.stop, watcher.paths, float(grace))
        if watcher.task is not None:
            watcher.pulse.notify()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait([watcher.task], timeout=5.0)
        result["state"] = watcher.state
        return result

    async def op_list(self, args: dict[str, Any]) -> dict[str, Any]:
        """Every run of this host."""
        return {"runs": [w.status() for _, w in sorted(self.daemon.runs.items())]}

    async def op_status(self, args: dict[str, Any]) -> dict[str, Any]:
        """One run."""
        return self.daemon.watcher(args).status()

    async def op_follow(self, args: dict[str, Any]) -> dict[str, Any]:
        """Validate a follow; the streams start right after the reply."""
        watcher = self.daemon.watcher(args)
        _int_arg(args, "after_seq", 0, 0, 1 << 62)
        if args.get("log_offset") is not None:
            _int_arg(args, "log_offset", 0, 0, 1 << 62)
        return {"run": watcher.paths.run, "last_seq": watcher.journal.last_seq}

    def _start_follow(self, args: dict[str, Any]) -> None:
        watcher = self.daemon.runs[args["run"]]
        self._stop_follow(args["run"])
        loop = asyncio.get_running_loop()
        after_seq = int(args.get("after_seq", 0))
        tasks = [loop.create_task(self._guard(stream_events(self.send_bytes, watcher, after_seq)))]
        if args.get("log_offset") is not None:
            # an attached log followed "from now" starts where watching did
            start = max(int(args["log_offset"]), attached.log_floor(watcher.paths))
            tasks.append(loop.create_task(self._guard(stream_log(self.send, watcher, start))))
        self.follows[args["run"]] = tasks

    async def _guard(self, coro: Awaitable[None]) -> None:
        try:
            await coro
        except (ConnectionError, BrokenPipeError):
            self.writer.close()

    def _stop_follow(self, run: str) -> bool:
        tasks = self.follows.pop(run, [])
        for task in tasks:
            task.cancel()
        return bool(tasks)

    async def op_unfollow(self, args: dict[str, Any]) -> dict[str, Any]:
        """End the streams of a followed run."""
        watcher = self.daemon.watcher(args)
        return {"run": watcher.paths.run, "was_following": self._stop_follow(watcher.paths.run)}

    async def op_read_log(self, args: dict[str, Any]) -> dict[str, Any]:
        """Raw log bytes from an offset (decoded with replacement)."""
        watcher = self.daemon.watcher(args)
        offset = max(_int_arg(args, "offset", 0, 0, 1 << 62), attached.log_floor(watcher.paths))
        limit = _int_arg(args, "limit", 65536, 1, 4 << 20)
        res = read_from(watcher.paths.log, offset, limit)
        return {
            "run": watcher.paths.run,
            "offset": res.offset,
            "next_offset": res.offset + len(res.data),
            "size": res.size,
            "data": res.data.decode("utf-8", "replace"),
        }

    async def op_check(self, args: dict[str, Any]) -> dict[str, Any]:
        """Check a capture file or directory (in a child process)."""
        path = args["path"]
        if not isinstance(path, str) or not path or "\0" in path:
            raise ProtocolError(ErrorCode.BAD_ARGS, "'path' must be a non-empty string")
        if not os.path.exists(path):
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no such path on this host: {path}")
        layers = args.get("layers")
        if isinstance(layers, list):
            layers = len(layers)
        for name, value in (("layers", layers), ("hidden_size", args.get("hidden_size"))):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ProtocolError(ErrorCode.BAD_ARGS, f"'{name}' must be a positive integer")
        return await check_file(path, layers=layers, hidden_size=args.get("hidden_size"))

    async def op_gpus(self, args: dict[str, Any]) -> dict[str, Any]:
        """nvidia-smi's view of the GPUs (empty lists without GPUs)."""
        from agent.jobs import gpus

        result: dict[str, Any] = await asyncio.to_thread(gpus.query)
        return result

    async def op_forecast(self, args: dict[str, Any]) -> dict[str, Any]:
        """Bytes a spec's run would write against free disk (the job's `--forecast`; no engine)."""
        try:
            view = JobSpec.parse(args["spec"])
        except SpecError as exc:
            raise ProtocolError(ErrorCode.BAD_ARGS, str(exc)) from None
        if view.backend == Backend.COMMAND:
            message = f"backend '{Backend.COMMAND}' writes nothing the agent knows of: no forecast"
            raise ProtocolError(ErrorCode.BAD_ARGS, message)
        if (unusable := await asyncio.to_thread(path_error, args["spec"], view.backend)) is not None:
            raise ProtocolError(ErrorCode.BAD_ARGS, f"spec.{unusable}")
        try:
            return await forecast(args["spec"], self.daemon.state_dir)
        except ForecastError as exc:
            raise ProtocolError(ErrorCode.FAILED, str(exc)) from None

    async def op_manifest(self, args: dict[str, Any]) -> dict[str, Any]:
        """A run's manifest.json (its dataset card) from its output_dir, without the per-sample token map."""
        watcher = self.daemon.watcher(args)
        if not watcher.spec.output_dir:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"run {watcher.paths.run!r} has no output_dir")
        try:
            return await asyncio.to_thread(read_manifest, Path(watcher.spec.output_dir))
        except ManifestError as exc:
            raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None

    async def op_shutdown(self, args: dict[str, Any]) -> dict[str, Any]:
        """Exit after this reply; jobs keep running."""
        return {"stopping": True}
