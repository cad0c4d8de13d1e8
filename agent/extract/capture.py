"""Per-request assembly of captured steps and the writer thread (device-agnostic; CUDA via gpu_copy)."""

from __future__ import annotations

import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from agent.extract.checks import apply_fault, check_sample
from agent.extract.writer import sample_path, write_sample


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
    if offset != sum(num_scheduled.values()):
        raise RuntimeError(
            f"batch order {order} covers {offset} tokens but the scheduler scheduled {sum(num_scheduled.values())}"
        )
    return spans


@dataclass
class _Request:
    idx: int
    prompt: list[int]
    buf: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class SinkConfig:
    """What the sink needs to finish a sample: output dir, expected shape, fault injection, failure policy."""

    output_dir: str
    layers: int
    hidden_size: int
    fault: str | None = None
    stop_on_failure: bool = False


class CaptureSink:
    """Assembles step tensors into per-request [T, L, H] buffers on a writer thread and writes finished samples.

    The forward thread only enqueues (host tensor or pinned view + CUDA event); the writer thread waits on
    the event, copies each request's rows into place by position (so chunked prefill, reordering and
    recomputation after preemption all land right), checks finished samples and writes them.
    """

    def __init__(self, cfg: SinkConfig) -> None:
        self.cfg = cfg
        self._reqs: dict[str, _Request] = {}
        self._q: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._results: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="eaglewatch-writer", daemon=True)
        self._thread.start()

    def register(self, req_id: str, idx: int, prompt: list[int]) -> None:
        """A new request entered the batch (called on the forward thread, ordered before its steps)."""
        self._q.put(("register", req_id, idx, list(prompt)))

    def submit(self, host: torch.Tensor, spans: list[Span], event: Any = None, release: Any = None) -> None:
        """Rows of one step; event (CUDA) is waited on before reading; release() returns a pinned buffer."""
        self._q.put(("step", host, spans, event, release))

    def drain(self) -> list[dict[str, Any]]:
        """Wait until everything submitted is processed; return (and forget) the finished-sample results."""
        self._q.join()
        with self._lock:
            out, self._results = self._results, []
        return out

    def pending(self) -> int:
        """Requests registered but not finished."""
        return len(self._reqs)

    def close(self) -> None:
        """Stop the writer thread after the queue empties."""
        self._q.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if item[0] == "register":
                    _, rid, idx, prompt = item
                    self._reqs[rid] = _Request(idx, prompt)
                else:
                    self._step(*item[1:])
            except Exception as e:  # noqa: BLE001 - reported to the driver, never lost in a thread
                with self._lock:
                    self._results.append(
                        {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
                    )
            finally:
                self._q.task_done()

    def _step(self, host: torch.Tensor, spans: list[Span], event: Any, release: Any) -> None:
        if event is not None:
            event.synchronize()
        try:
            for sp in spans:
                req = self._reqs.get(sp.req_id)
                if req is None:
                    continue  # not ours (e.g. a request without a sample index)
                total = len(req.prompt)
                n = min(sp.n, total - sp.start)  # rows past the prompt (decode) are not part of the sample
                if n <= 0:
                    continue
                if req.buf is None:
                    req.buf = torch.empty((total, *host.shape[1:]), dtype=host.dtype)
                    req.mask = torch.zeros(total, dtype=torch.bool)
                assert req.mask is not None
                req.buf[sp.start : sp.start + n].copy_(host[sp.offset : sp.offset + n])
                req.mask[sp.start : sp.start + n] = True
                if bool(req.mask.all()):
                    del self._reqs[sp.req_id]
                    self._finish(req)
        finally:
            if release is not None:
                release()

    def _finish(self, req: _Request) -> None:
        assert req.buf is not None
        cfg = self.cfg
        token_ids = torch.tensor(req.prompt, dtype=torch.int64)
        hidden = apply_fault(req.buf, cfg.fault)
        name = sample_path(cfg.output_dir, req.idx).name
        findings = check_sample(name, token_ids, hidden, req.prompt, cfg.layers, cfg.hidden_size)
        written, nbytes = False, 0
        if not (findings and cfg.stop_on_failure):
            _, nbytes = write_sample(cfg.output_dir, req.idx, token_ids, hidden)
            written = True
        result = {
            "idx": req.idx,
            "file": name,
            "tokens": len(req.prompt),
            "bytes": nbytes,
            "written": written,
            "problems": [f.to_dict() for f in findings],
        }
        with self._lock:
            self._results.append(result)
