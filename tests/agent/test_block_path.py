"""The raw-block path (``feed_block``: lines kept as bytes, rules decode only likely lines) gives exactly
what the line-by-line path gives: the same milestones (rule order, line numbers, ranks, per-rank dedupe,
tracebacks and root causes) and the same lines served to followers, over the real fixture logs and
synthetic ones, for random chunkings, seams (truncation/rotation) and idle releases."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from agent.logs.linebuffer import LineBuffer
from agent.logs.splitter import Block, BlockLines, LineSplitter, clean_block
from agent.milestones.engine import Milestone, MilestoneEngine, load_rules
from agent.milestones.rulefile import RuleSet
from tests.helpers.vllm_log import FAILURES, make_log, steady_lines

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RULES = load_rules()
VLLM_RULES = load_rules(backend="worker-extension")
CAP = 4096  # a small line cap, so over-long lines are common in the edge cases


def _edge_log(rnd: random.Random) -> bytes:
    """Pieces that need the splitter's care, between ordinary lines, in random order."""
    marker = 'EAGLEWATCH {"kind": "progress", "samples_done": 7}'
    record = json.dumps({"levelname": "ERROR", "message": "RuntimeError: CUDA error: out of memory"})
    pieces = [
        b"INFO 02-21 22:48:03 [loader.py:12] Loading weights took 12.5 seconds\n",
        b"(Worker_TP1 pid=7) INFO 02-21 22:48:03 [loader.py:12] Loading weights took 12.5 seconds\n",
        b"(Worker_TP0 pid=6) INFO 02-21 22:48:03 [loader.py:12] Loading weights took 12.4 seconds\n",
        b"caf\xc3\xa9 caf\xe9 invalid utf-8\n",
        "plain é line ✓\n".encode(),
        b"x" * (CAP + 10) + b"\n",
        b"y" * rnd.randint(1, 3 * CAP),
        b"\r",
        b"\r\n",
        b"bar 50%|\x1b[32m####\x1b[0m| 5/10\r",
        (marker + "\n").encode(),
        (record + "\n").encode(),
        b"Traceback (most recent call last):\n",
        b'  File "x.py", line 3, in f\n',
        b"RuntimeError: NCCL error: unhandled system error\n",
        b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n",
        b"\n",
        b"Killed\n",
    ]
    plain = [f"DEBUG 02-21 22:48:{i % 60:02d} [runner.py:9] step {i} done\n".encode() for i in range(40)]
    return b"".join(rnd.choice(pieces) if rnd.random() < 0.3 else rnd.choice(plain) for _ in range(600))


def _logs() -> list[tuple[str, bytes]]:
    logs = [(p.name, p.read_bytes()) for p in sorted(FIXTURES.glob("*.log"))]
    logs += [(f"synth-{f}", make_log(tp=4, failure=f, colours=i % 2 == 0)) for i, f in enumerate(FAILURES)]
    logs.append(("old-format", make_log(tp=2, fmt="old")))
    logs.append(("steady", ("\n".join(steady_lines(4000, tp=4)) + "\n").encode()))
    logs += [(f"edge-{seed}", _edge_log(random.Random(seed))) for seed in range(6)]
    logs.append(("unterminated", make_log(tp=2) + b"INFO 02-21 22:48:03 [x.py:1] no newline at the end"))
    return logs


def _chunks(data: bytes, rnd: random.Random) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        n = rnd.choice([1, 7, 100, 4096, 65536, 1 << 20, rnd.randint(1, 20000)])
        out.append(data[at : at + n])
        at += n
    return out


class _Path:
    """One way through splitter, engine and buffer; ``fast`` takes the raw-block path."""

    def __init__(self, rules: RuleSet, fast: bool) -> None:
        self.fast = fast
        self.splitter = LineSplitter(max_line_bytes=CAP)
        self.engine = MilestoneEngine(rules)
        self.buffer = LineBuffer(max_lines=10**9, max_bytes=1 << 40)
        self.buffer.reset(0)
        self.out: list[Milestone] = []
        self.n = 0
        self.blocks = 0

    def feed(self, chunk: bytes) -> None:
        if not self.fast:
            lines = self.splitter.feed(chunk)
            self.out += [m for i, ln in enumerate(lines) for m in self.engine.feed(ln.text, self.n + 1 + i)]
            self.n += len(lines)
            self.buffer.append(lines, self.splitter.pending_offset)
            return
        lines, block = self.splitter.feed_block(chunk)
        self.out += self.engine.feed_many([ln.text for ln in lines], self.n + 1)
        self.n += len(lines)
        self.buffer.append(lines, block.offset if block else self.splitter.pending_offset)
        if block is not None:
            self.blocks += 1
            self.out += self.engine.feed_block(block, self.n + 1)
            self.n += len(block.shapes)
            self.buffer.append_block(block, self.splitter.pending_offset)

    def seam(self, base: int) -> None:
        """What the watcher does where a generation ends: its last line is complete; go on at ``base``."""
        lines = self.splitter.flush()
        self.out += [m for i, ln in enumerate(lines) for m in self.engine.feed(ln.text, self.n + 1 + i)]
        self.n += len(lines)
        self.buffer.append(lines, base)
        self.splitter = LineSplitter(max_line_bytes=CAP, start_offset=base)

    def end(self) -> None:
        self.seam(self.splitter.pending_offset)
        self.out += self.engine.flush()


def _run(data: bytes, rules: RuleSet, seed: int, seams: bool = True) -> tuple[_Path, _Path]:
    rnd = random.Random(seed)
    ref, fast = _Path(rules, False), _Path(rules, True)
    offset = 0
    for chunk in _chunks(data, rnd):
        for p in (ref, fast):
            p.feed(chunk)
        offset += len(chunk)
        r = rnd.random()
        if seams and r < 0.05:  # truncated or rotated: the next generation starts at a later offset
            offset += rnd.randint(0, 50)
            for p in (ref, fast):
                p.seam(offset)
        elif r < 0.15:  # the watcher's idle release between reads
            for p in (ref, fast):
                p.out += p.engine.release_ready()
    for p in (ref, fast):
        p.end()
    return ref, fast


def _drain(buf: LineBuffer, pos: int, rnd: random.Random) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    while True:
        got = buf.read(pos, rnd.randint(1, 700), rnd.randint(1, 70000))
        assert got is not None
        lines, pos = got
        if not lines:
            return out
        out += lines


def _drain_text(buf: LineBuffer, pos: int, rnd: random.Random) -> str:
    parts: list[str] = []
    while True:
        got = buf.read_text(pos, rnd.randint(1, 70000))
        assert got is not None
        text, pos = got
        if not text:
            return "".join(parts)
        parts.append(text)


@pytest.mark.parametrize(("name", "data"), _logs(), ids=[n for n, _ in _logs()])
def test_block_path_equals_line_by_line(name: str, data: bytes) -> None:
    for seed in range(3):
        for rules in (RULES, VLLM_RULES):
            ref, fast = _run(data, rules, seed)
            assert fast.n == ref.n
            assert [m.to_dict() for m in fast.out] == [m.to_dict() for m in ref.out], (name, seed)
        rnd = random.Random(seed)
        every = _drain(ref.buffer, 0, rnd)
        assert _drain(fast.buffer, 0, rnd) == every
        assert _drain_text(fast.buffer, 0, rnd) == "".join(t + "\n" for _, t in every)
        for offset, _ in every[:: max(1, len(every) // 7)]:  # a follower may start at any line
            assert _drain(fast.buffer, offset, rnd) == [ln for ln in every if ln[0] >= offset]
    if name == "steady":
        assert fast.blocks > 0  # the fast path was taken, not only its fallback


def test_block_lines_decode_any_line_in_any_order() -> None:
    data = "a1\n\nβ22\nlast 3\n".encode()
    block = clean_block(data, 100, 64)
    assert block is not None and block.end == 100 + len(data)
    assert block.texts() == ["a1", "", "β22", "last 3"]
    view = BlockLines(block)
    assert [view[i] for i in (3, 0, 2, 1, -1)] == ["last 3", "a1", "β22", "", "last 3"]
    assert view[1:3] == ["", "β22"] and list(view) == block.texts() and len(view) == 4
    with pytest.raises(IndexError):
        view[4]


def test_lines_up_to_the_cap_stay_a_block() -> None:
    """Lines longer than half the cap fail the cheap window test; each line's length then decides."""
    for size in (31, 32, 33, 63, 64):
        data = b"a" * size + b"\nb\n" + b"c" * size + b"\n"
        block = clean_block(data, 0, 64)
        assert block is not None and list(map(len, block.shapes)) == [size, 1, size]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"ok\nbad \xff byte\n", "invalid UTF-8"),
        (b"ok\ncolour \x1b[32mgreen\n", "an escape sequence"),
        (b"ok\nbar\rredrawn\n", "a carriage return"),
        (b"ok\n" + b"z" * 65 + b"\n", "a line over the cap"),
    ],
)
def test_lines_that_need_the_splitter_are_no_block(data: bytes, why: str) -> None:
    assert clean_block(data, 0, 64) is None, why


def test_ten_megabyte_line_is_cut_on_both_paths() -> None:
    data = b"INFO start\n" + b"w" * 10_000_000 + b"\nKilled\nINFO tail\n"
    ref, fast = _run(data, RULES, 0, seams=False)
    assert [m.to_dict() for m in fast.out] == [m.to_dict() for m in ref.out]
    assert [m.kind for m in fast.out] == ["error"]  # Killed, on line 3
    lines = _drain(fast.buffer, 0, random.Random(0))
    assert lines == _drain(ref.buffer, 0, random.Random(0))
    assert lines[1][1].endswith("bytes dropped]") and lines[2] == (10_000_012, "Killed")


def test_block_memory_is_bounded() -> None:
    """Raw blocks count towards the bounds; followers behind what is held are sent to the log."""
    buf = LineBuffer(max_lines=5000, max_bytes=1 << 30)
    buf.reset(0)
    sp = LineSplitter()
    data = b"".join(f"line {i}\n".encode() for i in range(100_000))
    for at in range(0, len(data), 8192):
        lines, block = sp.feed_block(data[at : at + 8192])
        buf.append(lines, block.offset if block else sp.pending_offset)
        if block is not None:
            buf.append_block(block, sp.pending_offset)
    assert 4000 <= len(buf) <= 5000
    assert buf.read(0, 10, 1000) is None and buf.read_text(0, 1000) is None
    tail = len(b"line 99999\n")
    assert buf.read(buf.end - tail, 10, 1000) == ([(buf.end - tail, "line 99999")], buf.end)
    assert buf.read_text(buf.end - tail, 1000) == ("line 99999\n", buf.end)
    assert buf.read(buf.end - 3, 10, 1000) is None  # inside a line of a raw block


def test_block_type_is_frozen() -> None:
    block = Block(0, b"a\n", [b"a"])
    with pytest.raises(AttributeError):
        block.offset = 3  # type: ignore[misc]
