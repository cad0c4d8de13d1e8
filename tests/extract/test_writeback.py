"""Capture files pushed to disk as written (writeback.Writeback), against the real sync_file_range(2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent.extract.writing.writeback import Writeback, libc_sync_file_range
from agent.extract.writing.writer import write_sample

pytestmark = pytest.mark.skipif(libc_sync_file_range() is None, reason="sync_file_range is Linux only")


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _push_files(wb: Writeback, tmp_path: Path, n: int, size: int) -> None:
    for i in range(n):
        with open(tmp_path / f"f{i}", "wb") as fh:
            fh.write(b"x" * size)
            fh.flush()
            wb.push(os.dup(fh.fileno()), size)


def test_a_file_over_the_bound_is_on_disk_before_its_writer_goes_on(tmp_path: Path) -> None:
    before = _open_fds()
    wb = Writeback(limit_bytes=1)
    assert wb.active and wb.reason == ""
    _push_files(wb, tmp_path, n=4, size=4096)
    # each push waited for its own file's write-out: never more than one file pending
    assert wb.waits == 4 and wb.peak == 4096
    assert wb.fields() == {
        "writeback_wait_s": round(wb.wait_s, 3),
        "writeback_waits": 4,
        "writeback_peak_mb": 0.0,
    }
    wb.close()
    assert _open_fds() == before  # every dup'd descriptor was closed


def test_pending_bytes_stay_within_the_bound_plus_one_file(tmp_path: Path) -> None:
    before = _open_fds()
    wb = Writeback(limit_bytes=3 * 8192)
    _push_files(wb, tmp_path, n=40, size=8192)
    assert wb.peak <= 4 * 8192
    wb.close()
    assert _open_fds() == before


def test_under_the_bound_no_writer_waits(tmp_path: Path) -> None:
    wb = Writeback(limit_bytes=1 << 30)
    _push_files(wb, tmp_path, n=4, size=65536)
    assert wb.waits == 0 and wb.peak <= 4 * 65536
    wb.close()


def test_a_descriptor_that_refuses_turns_pacing_off_and_the_capture_goes_on(tmp_path: Path) -> None:
    before = _open_fds()
    wb = Writeback(limit_bytes=1)  # the push waits for the flusher, so the failure is known when it returns
    r, w = os.pipe()  # sync_file_range on a pipe fails (ESPIPE), as on a file system without it
    wb.push(w, 10)
    assert not wb.active and "Illegal seek" in wb.reason
    assert wb.fields()["writeback"] == wb.reason  # the job's capture_costs say pacing did not run, and why
    _push_files(wb, tmp_path, n=2, size=100)  # later files are still written; their descriptors closed
    assert (tmp_path / "f1").read_bytes() == b"x" * 100
    wb.close()
    os.close(r)
    assert _open_fds() == before


def test_off_closes_descriptors_and_says_so(tmp_path: Path) -> None:
    before = _open_fds()
    wb = Writeback(limit_bytes=0)
    _push_files(wb, tmp_path, n=2, size=10)
    assert not wb.active
    assert wb.fields() == {
        "writeback_wait_s": 0.0,
        "writeback_waits": 0,
        "writeback_peak_mb": 0.0,
        "writeback": "off",
    }
    assert _open_fds() == before


def test_sample_written_through_the_pacer_is_whole(tmp_path: Path) -> None:
    wb = Writeback(limit_bytes=1)  # each file is larger than the bound: on disk before the next
    hidden = torch.randn(7, 3, 16)
    for idx in range(3):
        path, size = write_sample(tmp_path, idx, torch.arange(7), hidden + idx, wb)
        assert path.stat().st_size == size
        got = load_file(str(path))
        assert torch.equal(got["hidden_states"], hidden + idx) and got["token_ids"].tolist() == list(range(7))
    assert wb.waits == 3
    wb.close()
    assert not list(tmp_path.glob(".*tmp"))


def test_a_flusher_that_breaks_never_leaves_a_writer_waiting(tmp_path: Path) -> None:
    """A bug inside the flusher (here a sync function that raises what the real call never does: a stand-in,
    since the kernel's call cannot be made to) turns pacing off and releases the waiting writer."""
    before = _open_fds()

    def broken(fd: int, offset: int, nbytes: int, flags: int) -> int:
        raise RuntimeError("boom")

    wb = Writeback(limit_bytes=1, sync=broken)
    _push_files(wb, tmp_path, n=2, size=100)  # the first push waits for the flusher, which breaks
    assert not wb.active and wb.reason == "the flusher stopped: RuntimeError: boom"
    wb.close()
    assert _open_fds() == before
