"""Per-request assembly of captured steps and the writer threads: the core the writer process runs."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agent.extract.capture.checks import apply_fault, check_sample, token_flags
from agent.extract.capture.costs import CaptureCosts
from agent.extract.capture.stats import file_stats, maybe_token_stats
from agent.extract.engine.canary import compare_with_file
from agent.extract.writing.writeback import DEFAULT_LIMIT_MB, Writeback
from agent.extract.writing.writer import sample_path, write_sample

if TYPE_CHECKING:
    from agent.spec import Fault


@dataclass(frozen=True)
class Span:
    """The n tokens of one request inside a step tensor: rows [offset, offset+n) are its positions start.."""

    req_id: str
    offset: int
    start: int
    n: int


def spans_for_step(order: list[str], num_scheduled: dict[str, int], starts: dict[str, int]) -> list[Span]:
    """Attribute the flattened tokens of one scheduler step to requests, in the runner's batch order."""
    spans, offset = [], 0
    for rid in order:
        n = num_scheduled.get(rid, 0)
        if n:
            spans.append(Span(rid, offset, starts[rid], n))
            offset += n
    want = sum(num_scheduled.values())
    if offset != want:
        raise RuntimeError(f"batch order {order} covers {offset} tokens but the scheduler scheduled {want}")
    return spans


@dataclass
class _Request:
    idx: int
    prompt: list[int]
    buf: torch.Tensor | None = None
    flags: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    stats: torch.Tensor | None = None  # per-token layer sums (stats.token_stats), assembled like flags
    canary: bool = False  # a re-capture alone: compared with the batched file, never written
    batched: bool = False  # some step of this request also carried other requests


class _Ref:
    """Counts users of one pinned buffer; the last one hands it back."""

    def __init__(self, release: Callable[[], None] | None) -> None:
        self._n, self._release, self._lock = 1, release, threading.Lock()

    def inc(self) -> None:
        with self._lock:
            self._n += 1

    def dec(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last and self._release is not None:
            self._release()


@dataclass(frozen=True)
class SinkConfig:
    """What the sink needs to finish a sample: output dir, expected shape, fault injection, failure policy."""

    output_dir: str
    layers: int
    hidden_size: int
    fault: Fault | None = None
    stop_on_failure: bool = False
    writers: int = 4
    writeback_mb: int = DEFAULT_LIMIT_MB  # capture bytes on their way to disk at most (0: the kernel decides)


class CaptureSink:
    """Assembles step tensors into per-request [T, L, H] samples (rows placed by position) and writes them
    from a small pool of writer threads; a prompt that came whole in one step is written from its buffer."""

    def __init__(self, cfg: SinkConfig) -> None:
        self.cfg = cfg
        self.costs = CaptureCosts()
        self.writeback = Writeback(cfg.writeback_mb << 20)
        self._reqs: dict[str, _Request] = {}
        self._q: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._results: list[dict[str, Any]] = []
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=cfg.writers, thread_name_prefix="eaglewatch-write")
        self._thread = threading.Thread(target=self._run, name="eaglewatch-assemble", daemon=True)
        self._thread.start()

    def register(self, req_id: str, idx: int, prompt: list[int], canary: bool = False) -> None:
        """A new request entered the batch (called on the forward thread, ordered before its steps)."""
        self._q.put(("register", req_id, idx, list(prompt), canary))

    def submit(
        self,
        host: torch.Tensor,
        spans: list[Span],
        release: Callable[[], None] | None = None,
        flags: torch.Tensor | None = None,
        stats: torch.Tensor | None = None,
    ) -> None:
        """Rows [tokens, L, H] of a step (+ token_flags, token_stats); release() frees them once used."""
        self._q.put(("step", host, spans, release, flags, stats))

    def drain(self, wait: bool = True) -> list[dict[str, Any]]:
        """Return (and forget) the finished-sample results; wait: first let everything submitted finish."""
        if wait:
            t0 = time.perf_counter()
            self._q.join()
            t1 = time.perf_counter()
            with self._lock:
                futures, self._futures = self._futures, []
            concurrent.futures.wait(futures)
            self.costs.add_drain(1000 * (t1 - t0), 1000 * (time.perf_counter() - t1))
        with self._lock:
            out, self._results = self._results, []
            self._futures = [f for f in self._futures if not f.done()]
        return out

    def cost_fields(self) -> dict[str, Any]:
        """The capture_costs fields: the capture's own and the disk write-out's."""
        return {**self.costs.fields(), **self.writeback.fields()}

    def close(self) -> None:
        """Stop the threads after the queue empties."""
        self._q.put(None)
        self._thread.join(timeout=60)
        self._pool.shutdown(wait=True)
        self.writeback.close()

    def _error(self, e: BaseException) -> None:
        with self._lock:
            self._results.append({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if item[0] == "register":
                    _, rid, idx, prompt, canary = item
                    self._reqs[rid] = _Request(idx, prompt, canary=canary)
                else:
                    self._step(*item[1:])
            except Exception as e:  # reported to the driver, never lost in a thread
                self._error(e)
            finally:
                self._q.task_done()

    def _step(
        self,
        host: torch.Tensor,
        spans: list[Span],
        release: Callable[[], None] | None,
        flags: torch.Tensor | None,
        stats: torch.Tensor | None,
    ) -> None:
        ref = _Ref(release)
        try:
            if flags is None:
                flags = token_flags(host)
            if stats is None:
                stats = maybe_token_stats(host)
            for sp in spans:
                req = self._reqs.get(sp.req_id)
                if req is None:
                    continue  # not ours (e.g. a request without a sample index)
                req.batched = req.batched or len(spans) > 1
                total = len(req.prompt)
                n = min(sp.n, total - sp.start)  # rows past the prompt (decode) are not part of the sample
                if n <= 0:
                    continue
                rows = slice(sp.offset, sp.offset + n)
                if req.buf is None and sp.start == 0 and n == total:
                    del self._reqs[sp.req_id]
                    ref.inc()
                    self._spawn(req, host[rows], flags[rows], ref.dec, None if stats is None else stats[rows])
                    continue
                if req.buf is None:
                    req.buf = torch.empty((total, *host.shape[1:]), dtype=host.dtype)
                    req.flags = torch.zeros((total, 2), dtype=torch.bool)
                    req.mask = torch.zeros(total, dtype=torch.bool)
                    if stats is not None:
                        req.stats = torch.zeros((total, *stats.shape[1:]), dtype=stats.dtype)
                assert req.mask is not None and req.flags is not None
                req.buf[sp.start : sp.start + n].copy_(host[rows])
                req.flags[sp.start : sp.start + n] = flags[rows]
                req.mask[sp.start : sp.start + n] = True
                if req.stats is not None and stats is not None:
                    req.stats[sp.start : sp.start + n] = stats[rows]
                if bool(req.mask.all()):
                    del self._reqs[sp.req_id]
                    self._spawn(req, req.buf, req.flags, None, req.stats)
        finally:
            ref.dec()

    def _spawn(
        self, req: _Request, hidden: torch.Tensor, flags: torch.Tensor, done: Any, stats: torch.Tensor | None
    ) -> None:
        fut = self._pool.submit(self._finish, req, hidden, flags, done, stats)
        with self._lock:
            self._futures.append(fut)

    def _finish(
        self, req: _Request, hidden: torch.Tensor, flags: torch.Tensor, done: Any, stats: torch.Tensor | None
    ) -> None:
        try:
            cfg = self.cfg
            token_ids = torch.tensor(req.prompt, dtype=torch.int64)
            if cfg.fault is not None:
                hidden, flags = apply_fault(hidden, cfg.fault, req.idx, req.batched), None  # type: ignore[assignment]
                stats = maybe_token_stats(hidden)
            if req.canary:  # compared with the batched file, never written
                diff = compare_with_file(sample_path(cfg.output_dir, req.idx), hidden)
                with self._lock:
                    self._results.append(
                        {"idx": req.idx, "canary": True, "rel_diff": diff, "tokens": len(req.prompt)}
                    )
                return
            name = sample_path(cfg.output_dir, req.idx).name
            findings = check_sample(name, token_ids, hidden, req.prompt, cfg.layers, cfg.hidden_size, flags)
            written, nbytes = False, 0
            if not (findings and cfg.stop_on_failure):
                t0 = time.perf_counter()
                _, nbytes = write_sample(cfg.output_dir, req.idx, token_ids, hidden, self.writeback)
                self.costs.add_write(time.perf_counter() - t0)
                written = True
            result = {
                "idx": req.idx,
                "file": name,
                "tokens": len(req.prompt),
                "bytes": nbytes,
                "written": written,
                "problems": [f.to_dict() for f in findings],
                # stats of a capture with a dropped layer would misname the ids: none then
                "layer_stats": None
                if stats is None or stats.shape[1] != cfg.layers
                else file_stats(stats, cfg.hidden_size),
            }
            with self._lock:
                self._results.append(result)
        except Exception as e:
            self._error(e)
        finally:
            if done is not None:
                done()
