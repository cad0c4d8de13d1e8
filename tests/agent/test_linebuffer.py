"""LineBuffer: followers get the watcher's split lines, bounded, once each, or are sent to the log."""

from __future__ import annotations

import random

import pytest

from agent.logs.linebuffer import LINE_OVERHEAD, LineBuffer
from agent.logs.splitter import LineSplitter
from tests.helpers.agentproc import log_lines


def _split(data: bytes, chunks: list[int]) -> tuple[LineBuffer, list[tuple[int, str]]]:
    """Feed ``data`` in chunks the way the watcher does; return the buffer and every line split."""
    buf, sp = LineBuffer(), LineSplitter()
    buf.reset(0)
    at, every = 0, []
    for n in [*chunks, len(data)]:
        lines = sp.feed(data[at : at + n])
        at += n
        buf.append(lines, sp.pending_offset)
        every += [(ln.offset, ln.text) for ln in lines]
    lines = sp.flush()
    buf.append(lines, sp.pending_offset)
    every += [(ln.offset, ln.text) for ln in lines]
    return buf, every


def _drain(buf: LineBuffer, pos: int, max_lines: int, max_bytes: int) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    while True:
        got = buf.read(pos, max_lines, max_bytes)
        assert got is not None
        lines, pos = got
        if not lines:
            return out
        assert len(lines) <= max_lines
        assert len(lines) == 1 or sum(len(t) + LINE_OVERHEAD for _, t in lines) <= max_bytes
        out += lines


@pytest.mark.parametrize("seed", range(20))
def test_followers_get_every_line_once_in_order(seed: int) -> None:
    rnd = random.Random(seed)
    data = b"".join(
        rnd.choice([b"a", b"bb\n", b"\r", b"\r\n", b"\n", "é".encode(), b"x" * rnd.randint(0, 300)])
        for _ in range(400)
    )
    buf, every = _split(data, [rnd.randint(0, 64) for _ in range(30)])
    max_lines, max_bytes = rnd.randint(1, 50), rnd.randint(1, 2000)
    assert _drain(buf, 0, max_lines, max_bytes) == every
    # From any line start the rest follows; from inside a line the follower is sent to the log.
    for offset, _ in every[:: max(1, len(every) // 10)]:
        assert _drain(buf, offset, max_lines, max_bytes) == [ln for ln in every if ln[0] >= offset]
    starts = {o for o, _ in every} | {buf.end}
    inside = next((o for o in range(buf.end) if o not in starts), None)
    if inside is not None:
        assert buf.read(inside, 10, 1000) is None


def test_bounded_memory_sends_old_followers_to_the_log() -> None:
    buf = LineBuffer(max_lines=100, max_bytes=10_000)
    buf.reset(0)
    sp = LineSplitter()
    for i in range(10_000):
        buf.append(sp.feed(f"line {i}\n".encode()), sp.pending_offset)
    assert len(buf) == 100
    assert buf.read(0, 10, 1000) is None  # trimmed away: read the log instead
    lines, nxt = buf.read(buf.end - 2 * len(b"line 9999\n"), 10, 1000) or ([], -1)
    assert [t for _, t in lines] == ["line 9998", "line 9999"] and nxt == buf.end
    big = LineBuffer(max_lines=10**6, max_bytes=1000)
    big.reset(0)
    big.append(LineSplitter().feed(b"y" * 5000 + b"\n"), 5001)
    assert big.read(0, 10, 100) is None and big.read(5001, 10, 100) == ([], 5001)


def test_nothing_held_serves_nothing() -> None:
    buf = LineBuffer()
    assert buf.read(0, 10, 100) is None  # an ended run's watcher splits nothing: followers read the log
    buf.reset(42)
    assert buf.read(42, 10, 100) == ([], 42) and buf.read(0, 10, 100) is None


async def test_a_follower_in_range_never_reads_the_log() -> None:
    """stream_log serves from the buffer; the log (chain) is touched only for offsets the buffer lacks."""
    import asyncio
    from types import SimpleNamespace

    from agent.daemon.streams import stream_log
    from agent.logs.generations import Chunk
    from agent.logs.tail import Broadcast

    data = b"".join(f"line {i}\n".encode() for i in range(2000))
    on_disk = len(b"line 0\n") * 10
    reads: list[int] = []

    def read_at(offset: int, max_bytes: int) -> Chunk:
        reads.append(offset)
        return Chunk(data[offset : min(on_disk, offset + max_bytes)], offset, False, offset >= on_disk)

    buf, changed = LineBuffer(), Broadcast()
    buf.reset(on_disk)  # the watcher resumed after line 9: lines 0-9 are only on disk
    watcher = SimpleNamespace(
        paths=SimpleNamespace(run="r"),
        lines=buf,
        log_changed=changed,
        chain=SimpleNamespace(read_at=read_at),
        summary=SimpleNamespace(terminal=None),
    )
    got: list[tuple[int, str]] = []

    async def send(msg: dict[str, object]) -> None:
        got.extend(log_lines(msg))

    task = asyncio.create_task(stream_log(send, watcher, 0))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    on_disk = len(data)  # the log grows; the watcher splits what it gained
    sp = LineSplitter(start_offset=buf.end)
    buf.append(sp.feed(data[buf.end :]), sp.pending_offset)
    changed.notify()
    for _ in range(100):
        if len(got) == 2000:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert [t for _, t in got] == [f"line {i}" for i in range(2000)]
    assert reads == [0]  # only the 10 lines before the buffer came from the log


async def test_a_live_log_goes_out_in_blocks_at_most_every_send_gap() -> None:
    """A job logging a line every 5 ms: its follower gets the lines in order, in blocks at least
    LOG_SEND_GAP_S apart (each block costs the controller a message and a commit), not a block a line."""
    import asyncio
    import itertools
    from types import SimpleNamespace

    from agent.daemon.streams import LOG_SEND_GAP_S, stream_log
    from agent.logs.tail import Broadcast

    buf, changed = LineBuffer(), Broadcast()
    buf.reset(0)
    watcher = SimpleNamespace(paths=SimpleNamespace(run="r"), lines=buf, log_changed=changed)
    loop = asyncio.get_running_loop()
    got: list[tuple[int, str]] = []
    sent_at: list[float] = []
    all_in = asyncio.Event()

    async def send(msg: dict[str, object]) -> None:
        sent_at.append(loop.time())
        got.extend(log_lines(msg))
        if len(got) == 40:
            all_in.set()

    task = asyncio.create_task(stream_log(send, watcher, 0))  # type: ignore[arg-type]
    sp = LineSplitter(start_offset=0)
    for i in range(40):
        buf.append(sp.feed(f"line {i}\n".encode()), sp.pending_offset)
        changed.notify()
        await asyncio.sleep(0.005)
    await asyncio.wait_for(all_in.wait(), 10)
    task.cancel()
    assert [t for _, t in got] == [f"line {i}" for i in range(40)]
    gaps = [b - a for a, b in itertools.pairwise(sent_at)]
    assert min(gaps) >= LOG_SEND_GAP_S * 0.9, gaps
    assert len(sent_at) < 40
