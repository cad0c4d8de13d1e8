"""Log blocks: the pure block (offsets, trim, validation), storing them exactly once on a real SQLite file,
reading lines back (API/page reader, feed), the supervisor's intake and the wire form."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent import protocol
from agent.daemon.streams import log_message
from controller import crud, queries
from controller.alerts import AlertPolicy
from controller.bus import Bus, BusEvent, parse_cursor
from controller.logblocks import Block, BlockError, pack_offsets, unpack_offsets
from controller.service import Controller
from controller.store import Store, connect, create_schema
from controller.supervisor import HostSupervisor
from tests.controller.test_store import _block, _milestone, _run
from tests.helpers.agentproc import decode_messages
from tests.web.conftest import settings_for
from web.app import create_app

QUIET = AlertPolicy(cooldown_s=0, deliver=False)


def _lines(start: int, n: int, offset: int = 0) -> list[tuple[int, str]]:
    """n ASCII lines ``line i`` from index ``start`` with natural offsets from ``offset``."""
    out, o = [], offset
    for i in range(start, start + n):
        out.append((o, f"line {i}"))
        o += len(f"line {i}") + 1
    return out


# --- pure ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offsets", "text", "nxt", "natural"),
    [
        ([0, 7, 14], "line 0\nline 1\nline 2", 21, True),
        ([5, 11], "ü€\nx", 13, True),  # UTF-8 lengths, not characters
        ([0, 8, 15], "line 0\nline 1\nline 2", 22, False),  # a \r\n ended the first line
        ([0, 2], "\ufffd\nb", 4, False),  # one invalid byte became three
        ([0], "", 1, True),  # one empty line
    ],
)
def test_offsets_are_kept_only_when_not_natural(
    offsets: list[int], text: str, nxt: int, natural: bool
) -> None:
    block = Block.make(offsets, text, nxt)
    assert (block.offsets is None) == natural
    assert block.lines() == list(zip(offsets, text.split("\n"), strict=True))
    msg = protocol.log_block("r", offsets, text, nxt)
    assert ("offsets" in msg) == (not natural)
    assert Block.from_message(decode_messages(protocol.encode(msg))[0]).lines() == block.lines()


@pytest.mark.parametrize(
    ("frontier", "kept"),
    [(0, [0, 1, 2, 3]), (7, [1, 2, 3]), (9, [2, 3]), (14, [2, 3]), (28, []), (100, [])],
)
def test_trim_keeps_the_lines_at_or_after_the_frontier(frontier: int, kept: list[int]) -> None:
    lines = _lines(0, 4)
    for block in (_block(lines), Block.make([o for o, _ in lines], "\n".join(t for _, t in lines), 40)):
        got = block.trim(frontier)
        assert (got.lines() if got else []) == [lines[i] for i in kept]


@pytest.mark.parametrize(
    ("msg", "word"),
    [
        ({"offset": -1, "next_offset": 3, "text": "a"}, "'offset'"),
        ({"offset": 0, "next_offset": 3, "text": 5}, "'text'"),
        ({"offset": 4, "next_offset": 4, "text": "a"}, "'next_offset'"),
        ({"offset": 0, "next_offset": 9, "text": "a\nb", "offsets": [0]}, "'offsets'"),
        ({"offset": 0, "next_offset": 9, "text": "a\nb", "offsets": [0, 0]}, "'offsets'"),
        ({"offset": 0, "next_offset": 9, "text": "a\nb", "offsets": [1, 3]}, "'offsets'"),
        ({"offset": 0, "next_offset": 3, "text": "a\nb", "offsets": [0, 5]}, "'offsets'"),
    ],
)
def test_malformed_blocks_are_refused_naming_the_field(msg: dict[str, Any], word: str) -> None:
    with pytest.raises(BlockError, match=word):
        Block.from_message({"type": "log_block", "run": "r", **msg})


def test_offsets_blob_round_trips_and_a_text_with_a_newline_is_no_block() -> None:
    offs = [0, 1, 2**40, 2**62]
    assert unpack_offsets(pack_offsets(offs)) == offs and len(pack_offsets(offs)) == 32
    with pytest.raises(ValueError, match="newlines"):
        protocol.log_block("r", [0], "two\nlines", 9)
    assert log_message("r", [(0, "a"), (2, "b")], 4) == protocol.log_block("r", [0, 2], "a\nb", 4)


# --- stored ---------------------------------------------------------------------------------------------


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    s = Store(tmp_path / "ew.db", Bus())
    await s.open()
    yield s
    await s.close()


async def _all(store: Store, run_id: str = "r-1") -> list[tuple[int, str]]:
    return [
        (ln["offset"], ln["text"])
        for ln in await store.read(queries.read_log, run_id, -1, 100000, None, False)
    ]


async def test_replayed_overlapping_and_partial_blocks_store_each_line_once(store: Store) -> None:
    """Blocks re-sent after a reconnect may repeat, overlap or start mid-way through what is stored: each
    line ends up stored exactly once, in order, and the run's log offset is where the next line starts."""
    await store.write(_run)
    lines = _lines(0, 100)
    end = lines[-1][0] + len(lines[-1][1]) + 1
    sub = store.bus.subscribe()
    sent = [
        _block(lines[0:40]),
        _block(lines[0:40]),  # the same block again (queued from the old link)
        _block(lines[20:60]),  # overlaps: half old, half new
        _block(lines[10:30]),  # all old
        _block(lines[60:100], end),
        _block(lines[90:100], end),  # a replayed tail
    ]
    new = [await store.write(partial(crud.add_log_block, run_id="r-1", block=b)) for b in sent]
    assert new == [40, 0, 20, 0, 40, 0]
    assert await _all(store) == lines
    assert (await store.read(queries.run_row, "r-1"))["log_offset"] == end
    published = []
    while not sub._queue.empty():
        ev = sub._queue.get_nowait()
        if ev is not None and ev.kind == "log":
            published += Block(**ev.data).lines()
    assert published == lines  # the bus carries each new line once too
    # paging as the API and the page do: forwards from an offset, backwards before one, search, errors
    mid = lines[49][0]
    assert [t for _, t in await _page(store, mid, 3)] == ["line 50", "line 51", "line 52"]
    assert [t for _, t in await _page(store, -1, 3, before=mid)] == ["line 46", "line 47", "line 48"]
    found = await store.read(queries.read_log, "r-1", -1, 5, "LINE 9", False)
    assert [ln["text"] for ln in found] == ["line 9", "line 90", "line 91", "line 92", "line 93"]


async def _page(store: Store, after: int, limit: int, before: int | None = None) -> list[tuple[int, str]]:
    got = await store.read(queries.read_log, "r-1", after, limit, None, False, before)
    return [(ln["offset"], ln["text"]) for ln in got]


async def test_feed_replays_blocks_in_commit_order_with_events(store: Store) -> None:
    sub = store.bus.subscribe()
    await store.write(_run)
    o = 0
    for i in range(1, 5):
        await store.write(partial(crud.apply_events, run_id="r-1", events=[_milestone(i)], policy=QUIET))
        lines = _lines(i * 10, 3, o)
        o = lines[-1][0] + len(lines[-1][1]) + 1
        await store.write(partial(crud.add_log_block, run_id="r-1", block=_block(lines)))
    live: list[BusEvent] = []
    while not sub._queue.empty():
        item = sub._queue.get_nowait()
        assert item is not None
        live.append(item)
    replay = await store.read(queries.feed_since, "r-1", None, 1000)
    assert [(e.kind, e.data, e.cursor) for e in replay] == [(e.kind, e.data, e.cursor) for e in live]
    logs = [e for e in replay if e.kind == "log"]
    assert len(logs) == 4 and all(parse_cursor(e.cursor)[1] > 0 for e in logs)
    rest = await store.read(queries.feed_since, "r-1", live[3].cursor, 1000)
    assert [e.cursor for e in rest] == [e.cursor for e in live[4:]]


async def test_the_supervisor_stores_overlapping_blocks_once_and_drops_a_malformed_one(
    store: Store, tmp_path: Path
) -> None:
    """``log_block`` messages as they come off the wire: a replayed overlap adds only its new lines, and a
    block that names an impossible offset is dropped (the link goes on)."""
    await store.write(_run)
    sup = HostSupervisor("h", settings_for(tmp_path / "home"), store, QUIET)
    lines = _lines(0, 10)
    for chunk in (lines[:6], lines[3:]):
        nxt = chunk[-1][0] + len(chunk[-1][1]) + 1
        msg = protocol.log_block("r-1", [o for o, _ in chunk], "\n".join(t for _, t in chunk), nxt)
        await sup.on_stream(decode_messages(protocol.encode(msg))[0])
    await sup.on_stream({"type": "log_block", "run": "r-1", "offset": -5, "next_offset": 1, "text": "x"})
    await store.write(lambda tx: None)  # behind the queued writes
    assert await _all(store) == lines


async def test_the_log_page_shows_block_lines_escaped_with_their_offsets(tmp_path: Path) -> None:
    """The run page renders stored block lines, escaped, each with its own offset (not the block's)."""
    async with Controller(settings_for(tmp_path / "home"), supervise=False) as ctl:
        await ctl.store.write(_run)
        evil = ["plain", "<script>alert(1)</script>", "a & b \ufffd"]
        offsets = [0, 8, 40]  # not the natural ones: a \r\n and replaced bytes
        block = Block.make(offsets, "\n".join(evil), 52)
        await ctl.store.write(partial(crud.add_log_block, run_id="r-1", block=block))
        app = create_app(ctl)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
        ) as c:
            page = (await c.get("/runs/r-1")).text
            api = (await c.get("/api/runs/r-1/log")).json()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    for o in offsets:
        assert f'data-offset="{o}"' in page
    assert [(ln["offset"], ln["text"]) for ln in api] == list(zip(offsets, evil, strict=True))


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    create_schema(db)
    conn = sqlite3.connect(db)
    conn.execute("INSERT INTO schema_version VALUES (3)")
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match="newer"):
        create_schema(db)


def _commits(store: Store) -> list[str]:
    """The COMMITs the store's writer connection runs from now on (until its trace callback is reset)."""
    commits: list[str] = []
    assert store._conn is not None
    store._conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    return commits


async def test_a_block_commits_at_once_while_the_writer_is_idle_and_queues_otherwise(store: Store) -> None:
    """``now_if_idle``: committed and published SOON_S after the first such block, in one transaction with
    the others that came meanwhile (``at_once``: when the loop's round ends, with those waiting), when
    nothing waits; behind what is queued (commit order kept) or when another process holds SQLite's write
    lock (then it waits its turn)."""
    await store.write(_run)
    sub = store.bus.subscribe()
    lines = _lines(0, 30)
    commits = _commits(store)
    add = partial(crud.add_log_block, run_id="r-1")
    fut = store.submit(partial(add, block=_block(lines[:4])), now_if_idle=True)
    fut2 = store.submit(partial(add, block=_block(lines[4:10])), now_if_idle=True)
    assert not fut.done() and sub._queue.empty()
    await asyncio.wait_for(fut, 5)
    assert fut2.done() and (fut.result(), fut2.result()) == (4, 6) and not sub._queue.empty()
    assert len(commits) == 1  # the two blocks: one transaction
    waits = store.submit(partial(add, block=_block(lines[10:12])), now_if_idle=True)
    urgent = store.submit(partial(add, block=_block(lines[12:14])), now_if_idle=True, at_once=True)
    await asyncio.sleep(0)  # the round ends: the urgent write commits, with the one waiting before it
    assert (waits.done(), urgent.done(), len(commits)) == (True, True, 2)
    assert (waits.result(), urgent.result()) == (2, 2)
    store._conn.set_trace_callback(None)
    queued = store.submit(partial(crud.add_log_block, run_id="r-1", block=_block(lines[14:20])))
    behind = store.submit(
        partial(crud.add_log_block, run_id="r-1", block=_block(lines[20:])), now_if_idle=True
    )
    assert not behind.done()
    assert (await queued, await behind) == (6, 10)
    other = connect(store.path)  # another process's writer
    other.execute("BEGIN IMMEDIATE")
    more = _lines(30, 5, lines[-1][0] + len(lines[-1][1]) + 1)
    late = store.submit(partial(crud.add_log_block, run_id="r-1", block=_block(more)), now_if_idle=True)
    await asyncio.sleep(0.05)
    assert not late.done()
    other.execute("COMMIT")
    other.close()
    assert await late == 5
    assert await _all(store) == lines + more


async def test_blocks_of_later_loop_rounds_share_one_commit_within_soon_s(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block that comes a few loop rounds after another, inside SOON_S, joins its commit (links' blocks
    arrive in different rounds; one commit each was most of the controller's CPU at 8 hosts x 8 runs).
    SOON_S is widened so that a busy test machine cannot close the window between the rounds."""
    import controller.store

    monkeypatch.setattr(controller.store, "SOON_S", 0.5)
    await store.write(_run)
    lines = _lines(0, 12)
    commits = _commits(store)
    add = partial(crud.add_log_block, run_id="r-1")
    first = store.submit(partial(add, block=_block(lines[:4])), now_if_idle=True)
    for _ in range(3):
        await asyncio.sleep(0)  # later rounds of the loop
    assert not first.done()
    second = store.submit(partial(add, block=_block(lines[4:])), now_if_idle=True)
    assert (await first, await second, len(commits)) == (4, 8, 1)
    store._conn.set_trace_callback(None)


async def test_the_feed_pages_big_blocks_by_size_and_paging_on_gets_everything_once(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page stops after about FEED_LOG_CHARS of log text; reading on from its last cursor until nothing is
    fresh (what the SSE backlog does) yields every item once, in commit order."""
    await store.write(_run)
    o = 0
    for i in range(1, 6):
        lines = _lines(i * 10, 8, o)
        o = lines[-1][0] + len(lines[-1][1]) + 1
        await store.write(partial(crud.add_log_block, run_id="r-1", block=_block(lines)))
        await store.write(partial(crud.apply_events, run_id="r-1", events=[_milestone(i)], policy=QUIET))
    whole = await store.read(queries.feed_since, "r-1", None, 1000)
    monkeypatch.setattr(queries, "FEED_LOG_CHARS", 60)  # about one block of 8 lines a page
    paged: list[BusEvent] = []
    cursor = None
    for _ in range(20):
        page = await store.read(queries.feed_since, "r-1", cursor, 1000)
        if not page:
            break
        assert len([e for e in page if e.kind == "log"]) <= 1
        paged += page
        cursor = page[-1].cursor
    assert [(e.kind, e.cursor) for e in paged] == [(e.kind, e.cursor) for e in whole]
    assert sum(Block(**e.data).count for e in paged if e.kind == "log") == 40


async def test_a_follow_sends_disk_and_buffer_lines_as_blocks() -> None:
    """stream_log: the lines a follower reads from the log itself (behind the watcher's
    buffer) and those the buffer serves both go out as ``log_block`` messages, every line once.  (The
    watcher is a stand-in here: its buffer, wake-up and log reader are the real ones.)"""
    from types import SimpleNamespace

    from agent.daemon.streams import stream_log
    from agent.logs.generations import Chunk
    from agent.logs.linebuffer import LineBuffer
    from agent.logs.splitter import LineSplitter
    from agent.logs.tail import Broadcast

    data = b"".join(f"line {i} \xc3\n".encode("latin-1") for i in range(3000))
    on_disk = data.index(b"line 10 ")

    def read_at(offset: int, max_bytes: int) -> Chunk:
        return Chunk(data[offset : min(on_disk, offset + max_bytes)], offset, False, offset >= on_disk)

    buf, changed = LineBuffer(), Broadcast()
    buf.reset(on_disk)
    watcher = SimpleNamespace(
        paths=SimpleNamespace(run="r"), lines=buf, log_changed=changed,
        chain=SimpleNamespace(read_at=read_at), summary=SimpleNamespace(terminal=None),
    )  # fmt: skip
    msgs: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        msgs.append(decode_messages(protocol.encode(msg))[0])

    task = asyncio.create_task(stream_log(send, watcher, 0))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    on_disk = len(data)
    sp = LineSplitter(start_offset=buf.end)
    buf.append(sp.feed(data[buf.end :]), sp.pending_offset)
    changed.notify()
    for _ in range(200):
        if sum(Block.from_message(m).count for m in msgs) >= 3000:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert {m["type"] for m in msgs} == {"log_block"} and len(msgs) >= 2
    ref = LineSplitter().feed(data)
    assert [ln for m in msgs for ln in Block.from_message(m).lines()] == [(ln.offset, ln.text) for ln in ref]


def test_a_blocks_text_travels_raw_after_its_line() -> None:
    """The wire form: a JSON line with ``size`` instead of ``text``, then the text's UTF-8 bytes and a
    newline; a stream of mixed messages decodes back to the same messages."""
    text = 'quote " back\\ ü € \u2028 <b>\n{"type": "event"}\n'
    block = protocol.log_block("r", [0, 20 + len("ü€\u2028".encode()), 60], text, 99)
    wire = protocol.encode(block)
    head, rest = wire.split(b"\n", 1)
    assert json.loads(head) == {k: v for k, v in block.items() if k != "text"} | {"size": len(text.encode())}
    assert rest == text.encode() + b"\n"  # raw: nothing escaped
    event = {"type": "event", "run": "r", "event": {"seq": 1}}
    stream = protocol.encode(event) + wire + protocol.encode(protocol.reply(3, {}))
    assert decode_messages(stream) == [event, block, protocol.reply(3, {})]


@pytest.mark.parametrize(
    ("head", "payload"),
    [
        ({"size": -1}, b"\n"),
        ({"size": "3"}, b"abc\n"),
        ({"size": protocol.MAX_PAYLOAD_BYTES + 1}, b"\n"),
        ({"size": 3}, b"abcd"),  # no newline where the payload should end
        ({"size": 3}, b"ab\n"),  # short
    ],
)
def test_a_malformed_block_payload_is_refused(head: dict[str, Any], payload: bytes) -> None:
    line = json.dumps({"type": "log_block", "run": "r", "offset": 0, "next_offset": 9, **head}).encode()
    with pytest.raises(protocol.ProtocolError):
        decode_messages(line + b"\n" + payload)
