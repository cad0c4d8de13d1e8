"""Benchmark: the two halves of the rules' work with a classifier child (agent/runs/classifier.py), each
against the pure splitter + rules loop on the same bytes, in one process (no pipe, no scheduling).

- pure: LineSplitter.feed_block (checks, digit folding) + MilestoneEngine.feed_block, as the daemon alone;
- child: a block's likely lines found (found.py ``find``: fold, prefilter, decode the hits) and their
  reply marshalled, as the classifier child does per block;
- daemon: the block checked (``feed_block(shapes=False)``: neither folded nor counted), the reply
  unmarshalled and fed to the engine (``feed_found``, numbered by the reply's count), as the daemon does
  with a child;
- journal lines: the milestones' events encoded (jsonline.encode_lines), which the daemon adds either way.

With a child the slower half bounds the catch-up; the pure loop is the baseline of bench_daemon_ingest.
Run: .venv/bin/python tests/bench/bench_rules_halves.py [--lines 500000] [--repeat 5]
``EAGLEWATCH_BENCH_QUICK=1`` makes the default 100000 lines. Prints BENCH lines for ``run_all.py``.
"""

from __future__ import annotations

import argparse
import marshal
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.logs.block import Block
from agent.logs.splitter import LineSplitter
from agent.milestones.engine import Milestone, MilestoneEngine, load_rules
from agent.milestones.found import Found, find
from agent.runs.jsonline import encode_lines
from agent.runs.log_ingest import READ_CHUNK
from tests.bench.run_all import bench_line
from tests.helpers.vllm_log import steady_lines


def _engine() -> MilestoneEngine:
    return MilestoneEngine(load_rules(backend="command"))  # the rules the daemon loads for a command run


def pure(chunks: list[bytes]) -> list[Milestone]:
    """The daemon's rules alone: split, fold, classify."""
    engine, sp, n, out = _engine(), LineSplitter(), 0, []
    for chunk in chunks:
        head, block = sp.feed_block(chunk)
        out += engine.feed_many([ln.text for ln in head], n + 1)
        n += len(head)
        if block is not None:
            out += engine.feed_block(block, n + 1)
            n += block.lines
    return out + engine.flush()


def child_blocks(chunks: list[bytes]) -> list[Block]:
    """The blocks the daemon sends a child (checked only: no shapes, not counted)."""
    sp, blocks = LineSplitter(), []
    for chunk in chunks:
        _head, block = sp.feed_block(chunk, False)
        if block is not None:
            blocks.append(block)
    return blocks


def child_half(blocks: list[Block]) -> list[bytes]:
    """What the child does per block: find its likely lines, marshal the reply."""
    prefilter = _engine().prefilter
    return [marshal.dumps(find(prefilter, b.data).to_tuple()) for b in blocks]


def daemon_half(chunks: list[bytes], replies: list[bytes]) -> list[Milestone]:
    """What the daemon does with a child: check each chunk, feed the child's hits and count to its engine."""
    engine, sp, n, out, it = _engine(), LineSplitter(), 0, [], iter(replies)
    for chunk in chunks:
        head, block = sp.feed_block(chunk, False)
        out += engine.feed_many([ln.text for ln in head], n + 1)
        n += len(head)
        if block is not None:
            found = Found(*marshal.loads(next(it)))
            out += engine.feed_found(block.data, found, n + 1)
            n += found.count
    return out + engine.flush()


def best_cpu(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """The least CPU seconds of ``repeat`` calls of ``fn``, and its last result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        result = fn()
        best = min(best, time.process_time() - t0)
    return best, result


def main() -> int:
    """Time each half against the pure loop and print BENCH lines."""
    quick = os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1"
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lines", type=int, default=100_000 if quick else 500_000)
    p.add_argument("--repeat", type=int, default=1 if quick else 5)
    args = p.parse_args()
    data = ("\n".join(steady_lines(args.lines)) + "\n").encode()
    chunks = [data[i : i + READ_CHUNK] for i in range(0, len(data), READ_CHUNK)]
    blocks = child_blocks(chunks)
    t_pure, want = best_cpu(lambda: pure(chunks), args.repeat)
    t_child, replies = best_cpu(lambda: child_half(blocks), args.repeat)
    assert isinstance(replies, list)
    t_daemon, got = best_cpu(lambda: daemon_half(chunks, replies), args.repeat)
    assert isinstance(want, list) and isinstance(got, list)
    if [m.to_dict() for m in got] != [m.to_dict() for m in want]:
        raise AssertionError("the halves gave other milestones than the pure loop")
    events = [{"seq": i + 1, "ts": 1.5, "type": "milestone", **m.to_dict()} for i, m in enumerate(want)]
    t_journal, _ = best_cpu(lambda: encode_lines(events), args.repeat)
    hits = sum(len(marshal.loads(r)[1]) for r in replies)
    size = f"{args.lines} lines, {len(data) / 1e6:.1f} MB"
    print(f"{size}, {hits} likely lines, {len(want)} milestones, best of {args.repeat}")
    note = f"{args.lines} lines, CPU s, best of {args.repeat} in one process; pure {t_pure:.3f} s"
    for label, t in (("child half", t_child), ("daemon half", t_daemon), ("journal lines", t_journal)):
        print(f"  {label:<14}: {t:.3f} s CPU, {t / t_pure:.2f}x the pure loop ({t_pure:.3f} s)")
        bench_line("rules_halves", f"{label} / pure", round(t / t_pure, 3), "x", note=note)
    slower = max(t_child, t_daemon + t_journal)
    print(f"  bound with a child: the pure loop at {t_pure / slower:.2f}x its own time (the slower half)")
    bench_line("rules_halves", "pure / slower half", round(t_pure / slower, 3), "x", note=note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
