"""The pool of long-lived check children: reports in order, one child reused, a dead child replaced."""

from __future__ import annotations

import json
import os
import signal
import struct
from pathlib import Path

from agent.checks.child import CheckPool


def _write(path: Path, layers: int = 4, zero: bool = False) -> None:
    ids = struct.pack("<2q", 1, 2)
    hs = (b"\0\0" if zero else struct.pack("<H", 0x3F80)) * (2 * layers * 8)
    header = {
        "token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},
        "hidden_states": {"dtype": "BF16", "shape": [2, layers, 8], "data_offsets": [16, 16 + len(hs)]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + ids + hs)


def _arg(path: Path) -> dict[str, object]:
    return {"path": str(path), "layers": 4, "hidden_size": 8, "deep": True}


async def test_a_batch_gets_its_reports_in_order_from_one_child(tmp_path: Path) -> None:
    _write(tmp_path / "hs_0.safetensors")
    _write(tmp_path / "hs_1.safetensors", zero=True)
    _write(tmp_path / "hs_2.safetensors", layers=3)
    pool = CheckPool(2)
    try:
        reports = await pool.check([_arg(tmp_path / f"hs_{i}.safetensors") for i in range(3)])
        again = await pool.check([_arg(tmp_path / "hs_0.safetensors")])
        children = {c.proc.pid for c in pool._all}
    finally:
        await pool.close()
    assert [[p["code"] for p in r["problems"]] for r in reports] == [
        [],
        ["all_zero"],
        ["layer_count_mismatch"],
    ]
    assert reports[0]["ok"] is True and again[0]["ok"] is True
    assert len(children) == 1  # one request at a time: the idle child took the second too


async def test_a_child_that_died_while_idle_is_replaced(tmp_path: Path) -> None:
    _write(tmp_path / "hs_0.safetensors")
    pool = CheckPool(1)
    try:
        await pool.check([_arg(tmp_path / "hs_0.safetensors")])
        (child,) = pool._all
        os.kill(child.proc.pid, signal.SIGKILL)
        await child.proc.wait()
        (report,) = await pool.check([_arg(tmp_path / "hs_0.safetensors")])
        assert {c.proc.pid for c in pool._all} != {child.proc.pid}
    finally:
        await pool.close()
    assert report["ok"] is True


async def test_a_bad_request_is_unchecked_and_the_child_goes_on(tmp_path: Path) -> None:
    _write(tmp_path / "hs_0.safetensors")
    pool = CheckPool(1)
    try:
        bad, good = await pool.check([{"path": 7}, _arg(tmp_path / "hs_0.safetensors")])
    finally:
        await pool.close()
    assert bad["unchecked"] and "bad check request" in bad["error"] and good["ok"] is True
