"""The writer process on its own (CPU, no engine): shared buffers, backpressure, a dead child, cleanup."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent.extract.capture.assembly import SinkConfig, Span
from agent.extract.writing.writer_proc import ProcessSink

L, H = 2, 16


def _memfds() -> int:
    """This process's mappings of capture buffers (anonymous memfds: nothing is named on disk)."""
    return Path(f"/proc/{os.getpid()}/maps").read_text().count("memfd:eaglewatch-capture")


def test_many_steps_through_two_buffers_keep_order_and_content(tmp_path: Path) -> None:
    # 40 steps through at most 2 shared buffers: submit must wait for the child's release, not overwrite
    sink = ProcessSink(SinkConfig(str(tmp_path), L, H), max_buffers=2)
    want = {}
    for i in range(40):
        rows = torch.randn((3 + i % 5, L, H), generator=torch.Generator().manual_seed(i))
        sink.register(f"r{i}", i, list(range(rows.shape[0])))
        sink.submit(rows, [Span(f"r{i}", 0, 0, rows.shape[0])])
        want[i] = rows.clone()
        rows.zero_()  # the caller may reuse its tensor at once: the sink staged a copy
    results = sink.drain()
    assert sorted(r["idx"] for r in results) == list(range(40))
    assert all(r["written"] and not r["problems"] for r in results)
    assert len(sink._segments) == 2  # the staging buffers never grew past the bound
    for i, rows in want.items():
        assert torch.equal(load_file(str(tmp_path / f"hs_{i}.safetensors"))["hidden_states"], rows)
    assert _memfds() >= 2 and not list(Path("/dev/shm").glob("eaglewatch-*"))
    sink.close()
    assert sink._proc.returncode == 0


def test_chunked_request_split_across_steps_and_buffers(tmp_path: Path) -> None:
    sink = ProcessSink(SinkConfig(str(tmp_path), L, H), max_buffers=1)
    a = torch.randn((9, L, H))
    sink.register("a", 7, list(range(9)))
    for lo, hi in ((0, 4), (4, 8), (8, 9)):
        sink.submit(a[lo:hi].clone(), [Span("a", 0, lo, hi - lo)])
    (res,) = sink.drain()
    assert res["idx"] == 7 and res["tokens"] == 9 and sink.drain() == []
    assert torch.equal(load_file(str(tmp_path / "hs_7.safetensors"))["hidden_states"], a)
    sink.close()


def test_a_dead_writer_process_fails_the_drain_with_a_reason(tmp_path: Path) -> None:
    sink = ProcessSink(SinkConfig(str(tmp_path), L, H))
    sink.register("r", 0, [1, 2])
    sink.submit(torch.ones((2, L, H)), [Span("r", 0, 0, 2)])
    assert len(sink.drain()) == 1
    os.kill(sink._proc.pid, signal.SIGKILL)
    sink._proc.wait()
    sink.register("s", 1, [1])
    with pytest.raises(RuntimeError, match=r"capture writer process (exited with status -9|unreachable)"):
        sink.submit(torch.ones((1, L, H)), [Span("s", 0, 0, 1)])
        sink.drain()
    sink.close()


def test_setup_waits_for_the_writer_process_to_start_and_a_waiting_drain_is_timed(tmp_path: Path) -> None:
    """wait_ready returns once the child has started (its torch import is not left to the first drain); a
    waiting drain records where its time went (this side's queue, then the child)."""
    sink = ProcessSink(SinkConfig(str(tmp_path), L, H))
    assert not sink._ready.is_set()  # just spawned: still importing torch
    waited = sink.wait_ready()
    assert sink._ready.is_set() and waited > 0
    assert sink.wait_ready() < 0.5  # started already: no wait
    sink.register("r", 0, [1, 2])
    sink.submit(torch.ones((2, L, H)), [Span("r", 0, 0, 2)])
    assert len(sink.drain(wait=True)) == 1
    got = sink.costs.fields()
    assert got["drain_child_ms_max"] > 0 and got["drain_queued_ms_max"] >= 0 and got["files"] == 1
    sink.close()


def test_a_writer_process_that_dies_at_start_fails_setup_with_a_reason(tmp_path: Path) -> None:
    sink = ProcessSink(SinkConfig(str(tmp_path), L, H))
    os.kill(sink._proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"capture writer process (exited with status -9|unreachable)"):
        sink.wait_ready(timeout=60)
    sink.close()


def test_drain_without_waiting_returns_what_is_done_and_loses_nothing(tmp_path: Path) -> None:
    sink = ProcessSink(SinkConfig(str(tmp_path), L, H))
    got: list[int] = []
    for i in range(30):
        sink.register(f"r{i}", i, [1, 2, 3])
        sink.submit(torch.ones((3, L, H)), [Span(f"r{i}", 0, 0, 3)])
        got += [r["idx"] for r in sink.drain(wait=False)]  # never blocks on the writer
    got += [r["idx"] for r in sink.drain()]
    sink.close()
    assert sorted(got) == list(range(30))  # each result exactly once across the drains
