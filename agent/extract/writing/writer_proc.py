"""The capture writer: a child process fed through shared memory, so the worker's forward thread never waits
for the GIL behind assembly, checks and file writes (writer threads inside the worker fell short on the H200).

The worker sends each step's buffer (a memfd, pinned on CUDA) over a Unix socket and a JSON line describing
it; the child (`python -m agent.extract.writing.writer_proc FD`) runs a CaptureSink and answers `release`
once it no longer needs a buffer (backpressure) and `drained` with the results.
"""

from __future__ import annotations

import array
import base64
import contextlib
import itertools
import json
import mmap
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import IO, Any

import torch

from agent.extract.capture.assembly import CaptureSink, SinkConfig, Span
from agent.extract.capture.costs import CaptureCosts
from agent.extract.capture.gpu_copy import BufferPool

#: capture_costs fields only the writer process knows: its last drain brings them back
WRITER_FIELDS = (
    "write_s",
    "files",
    "write_ms_p50",
    "write_ms_max",
    "drain_steps_ms_max",
    "drain_files_ms_max",
    "writeback_wait_s",
    "writeback_waits",
    "writeback",
)


def _map(fd: int, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    # populate now: faulting hundreds of MB in page by page would land inside the first steps
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, size, flags=flags)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


class _Segment:
    """One shared buffer: an anonymous memfd (no name to leak, no /dev/shm size limit), sent to the child
    over a Unix socket as soon as it exists."""

    def __init__(self, seg_id: int, size: int, pin: bool, sock: socket.socket) -> None:
        self.id, self.size = seg_id, size
        fd = os.memfd_create(f"eaglewatch-capture-{seg_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.mm, self.tensor = _map(fd, size)
            socket.send_fds(sock, [struct.pack("<Q", seg_id)], [fd])
        finally:
            os.close(fd)  # the mapping (and the child's copy of the fd) keep the memory
        self.base = self.tensor.data_ptr()
        self.pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.base, size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of a {size}-byte shared buffer failed: {err}")
            self.pinned = True

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False


class ProcessSink:
    """CaptureSink's interface, with the work done by a child process (see the module docstring)."""

    def __init__(self, cfg: SinkConfig, pin: bool = False, max_buffers: int = 6) -> None:
        self.cfg = cfg
        self.costs = CaptureCosts()  # the child's write time arrives with each drain
        self.pin = pin
        self._segments: dict[int, _Segment] = {}  # base pointer -> segment
        self._staging = BufferPool(max_buffers, self.alloc, self.free)  # for host-side submits
        self._q: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._releases: dict[int, Callable[[], None] | None] = {}
        self._ids = itertools.count()
        self._drained: queue.Queue[dict[str, Any]] = queue.Queue()
        self._dead: str | None = None
        self._drain_sent = 0.0  # when the forward thread sent the last drain to the child
        self._ready = threading.Event()  # the child has started (imports done) and holds its sink
        self._seg_ids = itertools.count()
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "agent.extract.writing.writer_proc", str(theirs.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
                cwd=os.getcwd(),
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._out: IO[bytes] = self._proc.stdin
        self._send({"op": "config", "config": asdict(cfg)})
        self._fwd = threading.Thread(target=self._forward, name="eaglewatch-forward", daemon=True)
        self._rd = threading.Thread(
            target=self._read, args=(self._proc.stdout,), name="eaglewatch-read", daemon=True
        )
        self._fwd.start()
        self._rd.start()

    # -- buffers --------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> torch.Tensor:
        """A new shared (and, on CUDA, pinned) buffer of nbytes: PinnedCopier's allocator."""
        seg = _Segment(next(self._seg_ids), nbytes, self.pin, self._sock)
        self._segments[seg.base] = seg
        return seg.tensor

    def free(self, buf: torch.Tensor) -> None:
        """Forget a buffer PinnedCopier dropped for a bigger one (its last step is already released)."""
        seg = self._segments.pop(buf.data_ptr(), None)
        if seg is not None:
            self._q.put(("forget", seg.id))
            seg.close()

    def _where(self, t: torch.Tensor) -> list[Any]:
        ptr = t.data_ptr()
        for base, seg in self._segments.items():
            if base <= ptr < base + seg.size:
                return [seg.id, seg.size, ptr - base, str(t.dtype).removeprefix("torch."), list(t.shape)]
        raise ValueError("tensor is not in a shared buffer")

    def _stage(self, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Copy host tensors into a shared buffer (CPU engine path); blocks when all buffers are in use."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        buf = self._staging.get(sum(n + (-n % 64) for n in sizes))
        views, at = [], 0
        for t, n in zip(tensors, sizes, strict=True):
            v = buf[at : at + n].view(t.dtype).view(t.shape)
            v.copy_(t)
            views.append(v)
            at += n + (-n % 64)
        return views, lambda: self._staging.put(buf)

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Block until the child has started (seconds waited); RuntimeError if it died or never did.

        Called at setup: the child's start (importing torch, seconds) then happens beside the engine's
        own setup instead of inside the first batch's drain."""
        t0 = time.monotonic()
        while not self._ready.wait(0.1):
            if self._dead is not None:
                raise RuntimeError(self._dead)
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"capture writer process did not start within {timeout:g} s")
        return time.monotonic() - t0

    # -- CaptureSink's interface ----------------------------------------------------------------------
    def register(self, req_id: str, idx: int, prompt: list[int], canary: bool = False) -> None:
        """A new request entered the batch (ordered before its steps)."""
        self._q.put(("register", req_id, idx, prompt, canary))

    def submit(
        self,
        host: torch.Tensor,
        spans: list[Span],
        event: Any = None,
        release: Callable[[], None] | None = None,
        flags: torch.Tensor | None = None,
        stats: torch.Tensor | None = None,
        timing: tuple[Any, ...] | None = None,
    ) -> None:
        """Rows [tokens, L, H] (+ token_flags, token_stats); staged into shared memory unless already so."""
        if flags is None:
            from agent.extract.capture.checks import token_flags

            flags = token_flags(host)
        try:
            where = self._where(host)
        except ValueError:
            views, release = self._stage(host, flags, *([] if stats is None else [stats]))
            host, flags, stats = views[0], views[1], views[2] if stats is not None else None
            where = self._where(host)
        # descriptors are made here, on the one thread that adds and drops segments
        stats_where = None if stats is None else self._where(stats)
        self._q.put(("step", where, self._where(flags), spans, event, release, stats_where, timing))

    def drain(self, wait: bool = True) -> list[dict[str, Any]]:
        """The child's finished-sample results; wait: once it has written everything submitted."""
        asked = time.perf_counter()
        self._q.put(("drain", wait))
        while True:
            try:
                reply = self._drained.get(timeout=5)
                break
            except queue.Empty:
                if self._dead is not None:
                    raise RuntimeError(self._dead) from None
        if "error" in reply:
            raise RuntimeError(str(reply["error"]))
        child = reply.get("costs") or {}
        self.costs.writer_fields = {k: child[k] for k in WRITER_FIELDS if k in child}
        if wait:  # where a waiting drain's time goes: this side's queue, then the child
            sent = self._drain_sent
            self.costs.add_drain_route(1000 * (sent - asked), 1000 * (time.perf_counter() - sent))
        return list(reply["results"])

    def cost_fields(self) -> dict[str, Any]:
        """The capture_costs fields (the child's own, writes and write-out, as its last drain said)."""
        return self.costs.fields()

    def close(self) -> None:
        """Let the child finish and exit; drop the shared buffers."""
        self._q.put(("close",))
        self._fwd.join(timeout=60)
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._rd.join(timeout=10)
        with contextlib.suppress(OSError):  # the child died with bytes unread in the pipe
            self._out.close()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        for seg in list(self._segments.values()):
            seg.close()
        self._segments.clear()
        self._sock.close()

    # -- threads --------------------------------------------------------------------------------------
    def _send(self, msg: dict[str, Any]) -> None:
        self._out.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        self._out.flush()

    def _forward(self) -> None:
        while True:
            item = self._q.get()
            try:
                op = item[0]
                if op == "step":
                    _, where, flags_where, spans, event, release, stats_where, timing = item
                    if event is not None:
                        event.synchronize()  # the copy has landed; waits without the GIL
                    self.costs.add_step_timing(timing)
                    k = next(self._ids)
                    self._releases[k] = release
                    rows = [[s.req_id, s.offset, s.start, s.n] for s in spans]
                    self._send(
                        {
                            "op": "step",
                            "id": k,
                            "rows": where,
                            "flags": flags_where,
                            "spans": rows,
                            "stats": stats_where,
                        }
                    )
                elif op == "register":
                    # token ids as base64 int64: a JSON list of 1k ints per prompt would hold this GIL
                    ids = base64.b64encode(array.array("q", item[3]).tobytes()).decode()
                    self._send(
                        {"op": "register", "req": item[1], "idx": item[2], "ids": ids, "canary": item[4]}
                    )
                elif op == "forget":
                    self._send({"op": "forget", "seg": item[1]})
                elif op == "drain":
                    self._drain_sent = time.perf_counter()
                    self._send({"op": "drain", "wait": item[1]})
                else:  # close
                    self._send({"op": "close"})
                    self._out.close()
                    return
            except (OSError, ValueError) as e:  # the child is gone: drain reports it
                self._dead = self._dead or f"capture writer process unreachable: {type(e).__name__}: {e}"
                if item[0] == "close":
                    return

    def _read(self, stream: IO[bytes]) -> None:
        try:
            for line in stream:
                msg = json.loads(line)
                if msg["op"] == "release":
                    release = self._releases.pop(int(msg["id"]), None)
                    if release is not None:
                        release()
                elif msg["op"] == "drained":
                    self._drained.put(msg)
                elif msg["op"] == "ready":
                    self._ready.set()
        except (ValueError, KeyError, TypeError) as e:  # a reply we cannot read: stop trusting the child
            self._dead = f"capture writer process sent an unreadable reply: {type(e).__name__}: {e}"
            self._proc.kill()
            return
        code = self._proc.wait()
        self._dead = f"capture writer process exited with status {code} (its stderr is in the job log)"


# -- the child ----------------------------------------------------------------------------------------
class _Child:
    """The writer process: maps the worker's buffers, feeds a CaptureSink, answers on its own stdout."""

    def __init__(self, out: IO[bytes], sock: socket.socket) -> None:
        self.out = out
        self.sock = sock
        self.lock = threading.Lock()
        self.maps: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
        self.sink: CaptureSink | None = None

    def send(self, msg: dict[str, Any]) -> None:
        with self.lock:
            self.out.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
            self.out.flush()

    def view(self, where: list[Any]) -> torch.Tensor:
        seg, size, offset, dtype, shape = where
        while seg not in self.maps:  # buffers arrive in the order they were made, before any use
            data, fds, _, _ = socket.recv_fds(self.sock, 8, 1)
            if not fds:
                raise RuntimeError(f"the worker closed the buffer socket before sending buffer {seg}")
            got = struct.unpack("<Q", data)[0]
            try:
                self.maps[got] = _map(fds[0], int(size) if got == seg else os.fstat(fds[0]).st_size)
            finally:
                os.close(fds[0])
        buf = self.maps[seg][1]
        dt = getattr(torch, dtype)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        return buf[offset : offset + n].view(dt).view(shape)

    def handle(self, msg: dict[str, Any]) -> bool:
        op = msg["op"]
        if op == "config":
            self.sink = CaptureSink(SinkConfig(**msg["config"]))
            self.send({"op": "ready"})
            return True
        assert self.sink is not None, "config must come first"
        if op == "register":
            ids = array.array("q")
            ids.frombytes(base64.b64decode(msg["ids"]))
            self.sink.register(msg["req"], int(msg["idx"]), ids.tolist(), bool(msg.get("canary")))
        elif op == "step":
            k = int(msg["id"])
            spans = [Span(str(r), int(o), int(s), int(n)) for r, o, s, n in msg["spans"]]
            self.sink.submit(
                self.view(msg["rows"]),
                spans,
                release=lambda: self.send({"op": "release", "id": k}),
                flags=self.view(msg["flags"]),
                stats=self.view(msg["stats"]) if msg.get("stats") else None,
            )
        elif op == "drain":
            results = self.sink.drain(wait=bool(msg.get("wait", True)))
            costs = self.sink.cost_fields()
            self.send({"op": "drained", "results": results, "costs": costs})
        elif op == "forget":
            self.maps.pop(int(msg["seg"]), None)
        elif op == "close":
            self.sink.close()
            self.sink = None
            return False
        return True


def main() -> None:
    """Child entry point: protocol on the original stdout; anything printed goes to stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    child = _Child(out, socket.socket(fileno=int(sys.argv[1])))
    for line in sys.stdin.buffer:
        if not child.handle(json.loads(line)):
            break
    if child.sink is not None:
        child.sink.close()


if __name__ == "__main__":
    main()
