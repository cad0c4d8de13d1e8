"""Log blocks end to end through a real sshd: awkward bytes survive, a dropped link replays exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.logs.splitter import LineSplitter
from agent.spec import parse_spec
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings
from tests.controller.conftest import wait_for
from tests.helpers.sshd import SSHD

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]

JOB = """\
import os, sys, time
go = sys.argv[1]
out = sys.stdout.buffer
for chunk in (b"plain\\n", b"bad \\xff\\xfe byte \\xe2\\x82\\n", b"crlf line\\r\\n",
              b"\\x1b[31mred\\x1b[0m\\n", "\\u00fcn\\u00efcode \\u20ac <b>&amp;</b>\\n".encode(),
              b"tqdm 10%\\rtqdm 20%\\r\\n", b"\\n"):
    out.write(chunk)
out.write(b"A" * 10_000_000 + b"\\n")
for i in range(2000):
    out.write(b"filler %d\\n" % i)
out.flush()
while not os.path.exists(go):
    time.sleep(0.02)
for i in range(3000):
    out.write(b"after %d \\xc3\\n" % i)
out.write(b"no newline at the end")
out.flush()
"""


def _reference(log: Path) -> list[tuple[int, str]]:
    """The lines the agent splits from the log, with their offsets (the last, unterminated one included)."""
    sp = LineSplitter()
    lines = sp.feed(log.read_bytes()) + sp.flush()
    return [(ln.offset, ln.text) for ln in lines]


async def test_awkward_lines_survive_blocks_and_a_dropped_link_replays_exactly_once(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings
) -> None:
    job, go = tmp_path / "job.py", tmp_path / "go"
    job.write_text(JOB)
    state = tmp_path / "agent"
    async with Controller(ssh_settings) as ctl:
        await ctl.add_host(
            HostCreate(name="gpu1", ssh="eaglehost", python="/usr/bin/python3", state_dir=str(state))
        )
        sup = ctl.supervisors.hosts["gpu1"]
        await sup.connected.wait()
        run_id = await ctl.create_run(
            parse_spec(
                {"host": "gpu1", "backend": "command", "command": ["/usr/bin/python3", str(job), str(go)]}
            )
        )

        async def first_part() -> bool:
            lines = await ctl.read_log(run_id, limit=100000)
            return bool(lines) and lines[-1]["text"] == "filler 1999"

        await wait_for(first_part, what="the first part of the log stored")
        assert sshd.kill_sessions() > 0  # the link drops; the next one follows from the stored offset
        go.write_text("")

        async def done() -> bool:
            run = await ctl.get_run(run_id)
            lines = await ctl.read_log(run_id, limit=100000)
            return run.state == "completed" and bool(lines) and lines[-1]["text"] == "no newline at the end"

        await wait_for(done, timeout=60, what="the whole log stored")
        stored = [(ln["offset"], ln["text"]) for ln in await ctl.read_log(run_id, limit=100000)]
    want = _reference(state / "runs" / run_id / "output.log")
    assert stored == want  # every line once, each with its own offset
    texts = [t for _, t in stored]
    assert "bad \ufffd\ufffd byte \ufffd" in texts and "crlf line" in texts and "red" in texts
    assert "tqdm 10%" in texts and texts[texts.index("tqdm 10%") + 1] == "tqdm 20%"
    big = next(t for t in texts if t.startswith("AAAA"))
    assert len(big) < 70_000 and big.endswith("bytes dropped]")
    assert "ünïcode € <b>&amp;</b>" in texts
