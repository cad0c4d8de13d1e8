"""Frames on a helper child's pipes (agent/runs/childpipe.py): parts written from where they lie arrive
whole and in order, however the pipe splits the writes."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest

from agent.runs.childpipe import FAILED, HEAD, read_exact, take_frame, write_all, write_frame


def _read_all(fd: int, into: bytearray) -> None:
    while chunk := os.read(fd, 1000):  # small reads: the writer finds the pipe full again and again
        into += chunk


def test_parts_cross_a_small_pipe_whole_and_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts far larger than a 4 KiB pipe, each writev cut short: nothing is lost or repeated, and empty
    parts are skipped.  A blocking pipe cuts a write short only when a signal interrupts it, so here each
    writev is handed at most 777 bytes of what it is given (the rest of the call is the real one)."""
    real = os.writev
    calls: list[int] = []

    def short(fd: int, buffers: list[memoryview]) -> int:
        room, head = 777, []
        for b in buffers:
            head.append(b[:room])
            room -= len(head[-1])
            if room <= 0:
                break
        calls.append(real(fd, head))
        return calls[-1]

    monkeypatch.setattr(os, "writev", short)
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    parts = [b"a" * 100_000, b"", b"b" * 3, bytes(range(256)) * 1000]
    got = bytearray()
    reader = threading.Thread(target=_read_all, args=(r, got))
    reader.start()
    try:
        write_all(w, *parts)
    finally:
        os.close(w)
        reader.join()
        os.close(r)
    assert bytes(got) == b"".join(parts)
    assert len(calls) > 400 and set(calls[:-1]) == {777}  # cut short every time, across part boundaries


def test_a_frame_is_its_length_then_op_then_payload() -> None:
    """``op`` comes before the payload and counts in the length; a failed frame's length has the top bit."""
    r, w = os.pipe()
    try:
        write_frame(w, b"payload", op=b"B")
        write_frame(w, b"boom", failed=True)
        (size,) = HEAD.unpack(read_exact(r, HEAD.size))
        assert size == 8 and read_exact(r, size) == b"Bpayload"
        buf = bytearray(read_exact(r, HEAD.size + 4))
        assert HEAD.unpack_from(buf)[0] & FAILED
        assert take_frame(buf) == (True, b"boom") and not buf
    finally:
        os.close(r)
        os.close(w)
