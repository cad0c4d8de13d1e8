"""Benchmark: where a log line's time goes, hop by hop, from the host's log to the browser's SSE bytes.

Each hop's own work runs in this one process over the same synthetic steady-state vLLM log, timed with
``time.process_time`` (CPU, one core) and profiled with cProfile (``--profile`` prints the top functions
of every hop):

1. agent watcher: LineSplitter → MilestoneEngine.feed_many → LineBuffer.append → journal append (fsync)
2. agent stream: LineBuffer.read blocks and journal events → protocol messages (``log_block``: one string
   for many lines) → JSON lines
3. controller link: JSON lines → messages (protocol.decode_message) → log blocks (Block.from_message)
4. controller store: crud.add_log_block per block (one row each) and crud.apply_event_batch for the events,
   in transactions of the store's writer (run here in the main thread) on a real SQLite file (WAL)
5. web: every BusEvent → SSE bytes (web/sse.py; log blocks as the run page asks for them)

What this leaves out is the transport itself (Unix socket, the bridge process, sshd, asyncssh): bench_link
measures the whole path through a real sshd against raw ``ssh tail -F`` and ``ssh cat``.
Run: ``python tests/bench/bench_hops.py [--lines 200000] [--profile]``; ``EAGLEWATCH_BENCH_QUICK=1`` makes
the default 50000 lines. Prints BENCH lines for ``run_all.py`` (µs per line per hop, share of the total).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent import protocol
from agent.daemon.streams import BLOCK_BYTES, BLOCK_LINES, log_message
from agent.logs.linebuffer import LineBuffer
from agent.logs.splitter import LineSplitter
from agent.milestones.engine import MilestoneEngine, load_rules
from agent.runs.journal import Journal
from controller import crud
from controller.alerts import AlertPolicy
from controller.bus import BusEvent
from controller.logblocks import Block
from controller.store import BATCH_MAX, Tx, connect, create_schema
from tests.bench.run_all import bench_line
from tests.helpers.vllm_log import steady_lines
from web.sse import encode as sse_encode
from web.sse import to_sse

T = TypeVar("T")
CHUNK = 256 * 1024  # the watcher's read size
QUIET = AlertPolicy(cooldown_s=0, deliver=False)


class Hops:
    """CPU seconds per hop, and a profile of each when asked."""

    def __init__(self, profile: bool) -> None:
        self.secs: dict[str, float] = {}
        self.profiles: dict[str, pstats.Stats] = {}
        self.profile = profile

    def run(self, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` as hop ``name``: time it, profile it when asked."""
        prof = cProfile.Profile() if self.profile else None
        t0 = time.process_time()
        if prof is not None:
            prof.enable()
        out = fn()
        if prof is not None:
            prof.disable()
        self.secs[name] = self.secs.get(name, 0.0) + time.process_time() - t0
        if prof is not None:
            self.profiles[name] = pstats.Stats(prof, stream=io.StringIO())
        return out


def watcher_hop(data: bytes, journal: Journal) -> tuple[LineBuffer, list[dict[str, Any]], int]:
    """What the daemon's watcher does with the log: one read, one split, rules, the buffer, the journal."""
    buf, splitter, engine = (
        LineBuffer(max_lines=10**7, max_bytes=1 << 40),
        LineSplitter(),
        MilestoneEngine(load_rules()),
    )
    buf.reset(0)
    events: list[dict[str, Any]] = []
    n = 0
    for i in range(0, len(data), CHUNK):
        lines = splitter.feed(data[i : i + CHUNK])
        found = engine.feed_many([ln.text for ln in lines], n + 1)
        n += len(lines)
        buf.append(lines, splitter.pending_offset)
        if found:
            events += journal.append_many([{"type": "milestone", **m.to_dict()} for m in found])
    found = engine.flush()
    events += journal.append_many([{"type": "milestone", **m.to_dict()} for m in found])
    return buf, events, n


def stream_hop(buf: LineBuffer, events: list[dict[str, Any]]) -> list[bytes]:
    """What a follower sends: log blocks read from the buffer and journal events, as JSON lines."""
    out = [protocol.encode(protocol.event("r-1", ev)) for ev in events]
    pos = 0
    while True:
        got = buf.read(pos, BLOCK_LINES, BLOCK_BYTES)
        assert got is not None
        lines, nxt = got
        if not lines:
            return out
        out.append(protocol.encode(log_message("r-1", lines, nxt)))
        pos = nxt


def link_hop(wire: list[bytes]) -> list[dict[str, Any]]:
    """What the controller's link reader does: decode each line; a log block's fields checked."""
    messages = [protocol.decode_messages(w)[0] for w in wire]
    for m in messages:
        if m["type"] == "log_block":
            m["block"] = Block.from_message(m)
    return messages


def store_hop(path: Path, messages: list[dict[str, Any]]) -> list[BusEvent]:
    """The controller's writes for those messages, as the store's writer runs them (one transaction per
    BATCH_MAX writes, a savepoint each) but in this thread, so cProfile sees them; the BusEvents made."""
    create_schema(path)
    conn = connect(path)
    conn.execute(
        "INSERT INTO runs(id, name, host, backend, spec_json, state, created_at, last_seq, log_offset)"
        " VALUES ('r-1','r','h','command','{}','running',0,0,0)"
    )
    evs = [("r-1", m["event"]) for m in messages if m["type"] == "event"]
    # As the supervisor's EventQueue hands them over: all the events that came, in one write.
    writes: list[Callable[..., Any]] = (
        [partial(crud.apply_event_batch, events=evs, policy=QUIET)] if evs else []
    )
    writes += [
        partial(crud.add_log_block, run_id="r-1", block=m["block"])
        for m in messages
        if m["type"] == "log_block"
    ]
    published: list[BusEvent] = []
    for at in range(0, len(writes), BATCH_MAX):
        conn.execute("BEGIN IMMEDIATE")
        tx = Tx(conn)
        for fn in writes[at : at + BATCH_MAX]:
            conn.execute("SAVEPOINT op")
            fn(tx=tx)
            conn.execute("RELEASE op")
        conn.execute("COMMIT")
        published += tx.events
    conn.close()
    return published


def main() -> int:
    """Run the hops over one synthetic log and print µs per line per hop."""
    ap = argparse.ArgumentParser()
    quick = os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1"
    ap.add_argument("--lines", type=int, default=50_000 if quick else 200_000)
    ap.add_argument("--profile", action="store_true", help="print each hop's top functions (cProfile)")
    args = ap.parse_args()
    data = ("\n".join(steady_lines(args.lines, tp=8)) + "\n").encode()
    hops = Hops(args.profile)
    with tempfile.TemporaryDirectory(prefix="ew-hops-") as tmp_s:
        tmp = Path(tmp_s)
        journal = Journal(tmp / "events.jsonl")
        buf, events, n = hops.run("1 agent watcher", lambda: watcher_hop(data, journal))
        journal.close()
        wire = hops.run("2 agent stream", lambda: stream_hop(buf, events))
        messages = hops.run("3 controller link", lambda: link_hop(wire))
        published = hops.run("4 controller store", lambda: store_hop(tmp / "ew.db", messages))
        sse = hops.run("5 web sse", lambda: [sse_encode(to_sse(ev)) for ev in published])
    total = sum(hops.secs.values())
    print(
        f"{n:,} lines ({len(data) / 1e6:.1f} MB), {len(events):,} journal events, {len(wire):,} protocol"
        f" messages ({sum(map(len, wire)) / 1e6:.1f} MB), {len(published):,} bus events, {len(sse):,} SSE"
        f" events; CPU time, one process"
    )
    for name, secs in hops.secs.items():
        us = secs / n * 1e6
        print(f"  {name:22s} {secs:6.2f} s  {us:6.2f} µs/line  {secs / total:6.1%}")
        bench_line(
            "hops", f"{name} us/line", round(us, 3), "us", note=f"{n} lines; {secs / total:.1%} of all"
        )
    print(f"  {'all hops':22s} {total:6.2f} s  {total / n * 1e6:6.2f} µs/line = {n / total:,.0f} lines/s")
    bench_line("hops", "all hops lines/s", round(n / total), "lines/s", note=f"{n} lines, CPU, one process")
    if args.profile:
        for name, stats in hops.profiles.items():
            out = io.StringIO()
            stats.stream = out  # type: ignore[attr-defined]
            stats.sort_stats("tottime").print_stats(8)
            body = out.getvalue()
            print(f"\n--- {name}: top functions by own time ---\n" + body[body.find("   ncalls") :])
    return 0


if __name__ == "__main__":
    sys.exit(main())
