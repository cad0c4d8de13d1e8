"""The rules' work in two halves (agent/milestones/found.py): likely lines found by a prefilter that is not
the engine's own, then fed to the engine, give exactly the milestones of the engine's own block path."""

from __future__ import annotations

import pytest

from agent.logs.splitter import LineSplitter
from agent.milestones.engine import MilestoneEngine, load_rules
from agent.milestones.found import Found, RawLines, find
from tests.helpers.vllm_log import make_log, steady_lines


def _data() -> bytes:
    """Steady TP=4 lines, a failing run (its traceback's lines are not all likely ones), steady lines."""
    steady = ("\n".join(steady_lines(8_000, tp=4, seed=3)) + "\n").encode()
    return steady + make_log(tp=4, failure="oom", seed=4) + steady


def _milestones(data: bytes, apart: bool, shapes: bool = True) -> list[dict[str, object]]:
    """Chunks through the splitter as the watcher reads them; each block fed whole (``apart`` False; a block
    made for a classifier child, neither folded nor counted, where ``shapes`` is False) or as hits found by
    a second engine's prefilter, which has seen nothing the first one has."""
    engine = MilestoneEngine(load_rules(backend="command"))
    finder = MilestoneEngine(load_rules(backend="command")).prefilter
    sp, n, out = LineSplitter(), 0, []
    for at in range(0, len(data), 32 * 1024):
        head, block = sp.feed_block(data[at : at + 32 * 1024], shapes and not apart)
        out += engine.feed_many([ln.text for ln in head], n + 1)
        n += len(head)
        if block is None:
            continue
        if apart:
            found = Found(*find(finder, block.data).to_tuple())  # as marshal carries it
            out += engine.feed_found(block.data, found, n + 1)
            n += found.count
        else:
            out += engine.feed_block(block, n + 1)
            n += block.lines if block.counted else block.data.count(b"\n")
    out += engine.feed_many([ln.text for ln in sp.flush()], n + 1) + engine.flush()
    return [m.to_dict() for m in out]


def test_hits_found_apart_give_the_block_paths_milestones() -> None:
    """Rank groups, a traceback (every line of it read while it is open) and steady markers: the same
    milestones in the same order either way."""
    want = _milestones(_data(), apart=False)
    assert len(want) > 200 and any(m["kind"] == "error" for m in want)
    assert _milestones(_data(), apart=True) == want


def test_a_block_made_for_a_child_is_fed_whole() -> None:
    """A block made for a classifier child (no shapes, not counted) and fed to an engine of its own anyway:
    its lines are folded there, not taken for none."""
    head, block = LineSplitter().feed_block(_data(), False)
    assert len(head) == 1 and block is not None and not block.counted and not block.shapes
    assert _milestones(_data(), apart=False, shapes=False) == _milestones(_data(), apart=False)


def test_found_names_only_likely_lines() -> None:
    """Lines no rule can match are not hits; a hit's shape is its line with digits folded, its text the
    line itself."""
    lines = [b"DEBUG nothing to see 12", b"INFO Avg prompt throughput: 12.5 tokens/s", b"DEBUG idle 7"]
    found = find(MilestoneEngine(load_rules()).prefilter, b"\n".join(lines) + b"\n")
    assert found.count == 3 and found.hits == [1]
    assert found.keys == [b"INFO Avg prompt throughput: 00.0 tokens/s"]
    assert found.texts == ["INFO Avg prompt throughput: 12.5 tokens/s"]


def test_raw_lines_decode_on_first_use_and_check_the_count() -> None:
    """Every line on demand; a block holding another number of lines than it was said to is an error that
    names both numbers."""
    lines = RawLines("é\nb\nc\n".encode(), 3)
    assert len(lines) == 3 and lines[0] == "é" and lines[-1] == "c" and lines[1:] == ["b", "c"]
    with pytest.raises(ValueError, match="said to hold 4 lines holds 3"):
        RawLines(b"a\nb\nc\n", 4)[0]
