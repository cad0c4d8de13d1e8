"""Benchmark: log line on the "remote" host → committed in SQLite, through a real loopback sshd.

1. Latency: a job appends 10k timestamped lines (at a steady rate) to its log; we measure, per line, the time
   until the controller has committed it (the BusEvent is published right after the commit), and in the same
   run the time until the same line comes out of a raw ``ssh -F cfg host tail -F output.log``.  The goal is
   p99 <= 150 ms.  The ratio to raw tail is shown, with no goal: the agent sends a busy live log in blocks at
   most every LOG_SEND_GAP_S (agent/daemon/streams.py), so a line waits for its block by design.
2. Sustained ingestion: a job writes 200k lines as fast as it can; lines/s from first to last committed,
   checking that every line arrived exactly once; in the same run, lines/s of a raw ``ssh host cat`` of
   the same log (the ceiling of moving those bytes through the same sshd).
3. The store alone: idempotent inserts of log lines in blocks (the writer's ceiling).

Run: ``.venv/bin/python tests/bench/bench_link.py [--lines 10000] [--rate 2000] [--bulk 200000]``
``EAGLEWATCH_BENCH_QUICK=1`` shrinks the defaults (2000 latency lines, 50000 bulk and store lines). Prints
BENCH lines for ``run_all.py``; exits 77 without ``/usr/sbin/sshd``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.spec import parse_spec  # noqa: E402
from controller import crud  # noqa: E402
from controller.bus import Bus  # noqa: E402
from controller.logblocks import Block  # noqa: E402
from controller.models import HostCreate  # noqa: E402
from controller.service import Controller  # noqa: E402
from controller.settings import Settings  # noqa: E402
from controller.store import Store  # noqa: E402
from tests.bench.run_all import SKIP_EXIT, bench_line  # noqa: E402
from tests.helpers.sshd import SSHD, SSHD_BIN, kill_tree_matching  # noqa: E402

JOB = """\
import os, sys, time
go, n, rate = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
while not os.path.exists(go):
    time.sleep(0.005)
start = time.time()
out = sys.stdout
for i in range(n):
    if rate > 0:
        delay = start + i / rate - time.time()
        if delay > 0:
            time.sleep(delay)
        out.write(f"lat {i} {time.time():.6f}\\n")
        out.flush()
    else:
        out.write(f"bulk {i} {'x' * 60}\\n")
out.flush()
"""


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


async def start_job(ctl: Controller, job: Path, go: Path, n: int, rate: float) -> str:
    return await ctl.create_run(
        parse_spec(
            {
                "host": "h",
                "backend": "command",
                "name": "bench",
                "command": ["/usr/bin/python3", str(job), str(go), str(n), str(rate)],
            }
        )
    )


async def latency(ctl: Controller, sshd: SSHD, tmp: Path, job: Path, n: int, rate: float) -> None:
    """Per-line latency, controller commit vs raw ssh tail -F; prints it and the BENCH lines."""
    go = tmp / "go-lat"
    run_id = await start_job(ctl, job, go, n, rate)
    log = tmp / "agent" / "runs" / run_id / "output.log"
    ours: dict[int, float] = {}
    raw: dict[int, float] = {}
    sub = ctl.bus.subscribe()

    async def consume() -> None:
        async for ev in sub:
            if ev.kind == "log" and ev.run_id == run_id:
                now = time.time()
                for text in ev.data["text"].split("\n"):
                    parts = text.split()
                    if len(parts) == 3 and parts[0] == "lat":
                        ours[int(parts[1])] = now - float(parts[2])
                if len(ours) >= n:
                    return

    tail = await asyncio.create_subprocess_exec(
        *sshd.ssh_argv("tail", "-n", "+1", "-F", str(log)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )

    async def consume_raw() -> None:
        assert tail.stdout is not None
        while len(raw) < n:
            line = await tail.stdout.readline()
            if not line:
                return
            now = time.time()
            parts = line.split()
            if len(parts) == 3 and parts[0] == b"lat":
                raw[int(parts[1])] = now - float(parts[2])

    await asyncio.sleep(1.0)  # let tail and the follow start
    go.write_text("")
    try:
        await asyncio.wait_for(asyncio.gather(consume(), consume_raw()), timeout=n / rate + 60)
    finally:
        tail.kill()
        await tail.wait()
        sub.close()
    o = [v * 1000 for v in ours.values()]
    r = [v * 1000 for v in raw.values()]
    print(f"latency over {len(o)} lines at {rate:.0f} lines/s (ms):")
    print(
        f"  controller (line appended -> committed in SQLite): p50 {pct(o, 50):7.2f}  p99 {pct(o, 99):7.2f}"
        f"  max {max(o):7.2f}"
    )
    print(
        f"  raw ssh tail -F                                  : p50 {pct(r, 50):7.2f}  p99 {pct(r, 99):7.2f}"
        f"  max {max(r):7.2f}"
    )
    print(
        f"  ratio controller/raw: p50 {pct(o, 50) / pct(r, 50):.2f}x, p99 {pct(o, 99) / pct(r, 99):.2f}x"
        "   (no goal: lines wait for their block)"
    )
    note = f"{len(o)} lines at {rate:.0f} lines/s; baseline = raw ssh tail -F"
    for q in (50, 99):
        bench_line(
            "link",
            f"latency p{q}",
            round(pct(o, q), 2),
            "ms",
            goal="<= 150" if q == 99 else None,
            baseline=round(pct(r, q), 2),
            note=note,
        )
    for q in (99, 50):
        ratio = round(pct(o, q) / pct(r, q), 3)
        bench_line("link", f"latency p{q} ratio to raw tail", ratio, "x", note=note)


async def raw_cat(sshd: SSHD, log: Path) -> tuple[int, float]:
    """Lines and seconds, first byte to last, of a raw ``ssh host cat LOG`` (what the link is compared to;
    first to last, like the link's figure, so ssh's own start-up is left out of both)."""
    proc = await asyncio.create_subprocess_exec(
        *sshd.ssh_argv("cat", str(log)), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    assert proc.stdout is not None
    lines, first = 0, 0.0
    while chunk := await proc.stdout.read(1 << 20):
        first = first or time.perf_counter()
        lines += chunk.count(b"\n")
    last = time.perf_counter()
    await proc.wait()
    return lines, max(last - first, 1e-9)


async def bulk(ctl: Controller, sshd: SSHD, tmp: Path, job: Path, n: int) -> None:
    """Sustained ingestion of n lines written flat out; prints lines/s, loss and the BENCH lines."""
    go = tmp / "go-bulk"
    run_id = await start_job(ctl, job, go, n, 0)
    sub = ctl.bus.subscribe()
    spans: list[tuple[int, int]] = []  # each committed block's [offset, next_offset)
    got = 0
    first = last = 0.0

    async def consume() -> None:
        # Blocks, not lines, while timing: per-line work here would run on the controller's own core.
        nonlocal first, last, got
        async for ev in sub:
            if ev.kind == "log" and ev.run_id == run_id:
                if not first:
                    first = time.time()
                spans.append((ev.data["offset"], ev.data["next_offset"]))
                got += ev.data["text"].count("\n") + 1
                last = time.time()
                if got >= n:
                    return

    task = asyncio.create_task(consume())
    t0 = time.time()
    go.write_text("")
    await asyncio.wait_for(task, timeout=300)
    sub.close()
    spans.sort()
    overlaps = sum(b[0] < a[1] for a, b in itertools.pairwise(spans))
    texts: list[str] = []  # what the store holds, read back line by line once the clock stopped
    after = -1
    while page := await ctl.read_log(run_id, after_offset=after, limit=100_000):
        texts += [ln["text"] for ln in page]
        after = page[-1]["offset"]
    stored = len(texts)
    dup = stored - len(set(texts)) + overlaps + max(0, got - n)
    seen = {int(t.split()[1]) for t in texts if t.startswith("bulk ")}
    print(
        f"sustained ingestion: {n} lines in {last - first:.2f}s from first to last commit = "
        f"{n / max(last - first, 1e-9):,.0f} lines/s ({n / (last - t0):,.0f} lines/s incl. start)"
    )
    print(
        f"  stored {stored} lines, duplicates seen {dup}, lost {n - len(seen)}"
        "  (goal >= 50,000 lines/s, no loss)"
    )
    note = f"{n} lines, first to last commit"
    bench_line(
        "link",
        "sustained ingestion",
        round(n / max(last - first, 1e-9)),
        "lines/s",
        goal=">= 50000",
        note=note,
    )
    bench_line("link", "lost lines", n - len(seen), "lines", goal="<= 0", note=note)
    raw_n, raw_s = await raw_cat(sshd, tmp / "agent" / "runs" / run_id / "output.log")
    ours, raw = n / max(last - first, 1e-9), raw_n / raw_s
    print(f"  raw ssh cat of the same log: {raw_n} lines in {raw_s:.2f}s = {raw:,.0f} lines/s")
    print(f"  ratio link/raw ssh cat: {ours / raw:.3f}   (goal >= 0.25)")
    bench_line(
        "link",
        "sustained ratio to raw ssh cat",
        round(ours / raw, 3),
        "x",
        goal=">= 0.25",
        baseline=round(raw),
        note=f"{note}; baseline = ssh host cat of the same log, lines/s first to last byte",
    )
    bench_line("link", "duplicate lines", dup, "lines", note=f"stored {stored}")


async def store_only(tmp: Path, n: int = 200_000, batch: int = 500) -> None:
    """The store's ceiling: idempotent inserts of n log lines, in blocks."""
    store = Store(tmp / "store-only.db", Bus())
    await store.open()
    await store.write(
        lambda tx: tx.conn.execute(
            "INSERT INTO runs(id, name, host, backend, spec_json, state, created_at, last_seq, log_offset)"
            " VALUES ('r','r','h','c','{}',"
            "'running',0,0,0)"
        )
    )
    blocks = []
    for start in range(0, n, batch):
        texts = [f"bulk {i:06d} {'x' * 60}" for i in range(start, start + batch)]
        blocks.append(
            Block.make([i * 73 for i in range(start, start + batch)], "\n".join(texts), (start + batch) * 73)
        )
    t0 = time.perf_counter()
    futs = [store.submit(partial(crud.add_log_block, run_id="r", block=b)) for b in blocks]
    await asyncio.gather(*futs)
    dt = time.perf_counter() - t0
    await store.close()
    print(f"store alone: {n} lines in blocks of {batch}: {n / dt:,.0f} lines/s")
    bench_line("link", "store alone", round(n / dt), "lines/s", note=f"{n} lines, blocks of {batch}")


async def main() -> None:
    """Start a loopback sshd and a controller, then run the three measurements."""
    quick = os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1"
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=2000 if quick else 10_000)
    ap.add_argument("--rate", type=float, default=2000)
    ap.add_argument("--bulk", type=int, default=50_000 if quick else 200_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ew-bench-"))
    sshd = SSHD.start(tmp / "sshd")
    job = tmp / "job.py"
    job.write_text(JOB)
    settings = Settings(
        home=tmp / "home",
        known_hosts=sshd.known_hosts,
        ssh_config=sshd.ssh_config,
        remote_base=str(tmp / "remote"),
    )
    try:
        async with Controller(settings) as ctl:
            await ctl.add_host(
                HostCreate(name="h", ssh=sshd.alias, python="/usr/bin/python3", state_dir=str(tmp / "agent"))
            )
            await ctl.supervisors.hosts["h"].connected.wait()
            await latency(ctl, sshd, tmp, job, args.lines, args.rate)
            await bulk(ctl, sshd, tmp, job, args.bulk)
        await store_only(tmp, 50_000 if quick else 200_000)
    finally:
        sshd.stop()
        kill_tree_matching(str(tmp) + "/")


if __name__ == "__main__":
    if not Path(SSHD_BIN).exists():
        print(f"cannot run here: no OpenSSH server at {SSHD_BIN}")
        sys.exit(SKIP_EXIT)
    if "--profile" in sys.argv:
        import cProfile
        import pstats

        sys.argv.remove("--profile")
        cProfile.run("asyncio.run(main())", "/tmp/bench.prof")
        pstats.Stats("/tmp/bench.prof").sort_stats("tottime").print_stats(25)
    else:
        asyncio.run(main())
