"""Runs through the facade with the local transport (a real agent daemon over pipes, no SSH)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from agent.spec import parse_spec
from controller import crud
from controller.errors import Conflict, NotFound, SpecInvalid
from controller.logblocks import Block
from controller.models import HostCreate, parse_run_spec
from controller.service import Controller
from controller.settings import Settings
from tests.controller.conftest import wait_for
from tests.controller.test_alerts import Receiver
from tests.controller.test_store import _block
from tests.helpers.sshd import free_port

pytestmark = pytest.mark.timeout(120)


def _host(tmp_path: Path) -> HostCreate:
    return HostCreate(name="loc", ssh="local", state_dir=str(tmp_path / "agent"))


def _cmd(job_script: Path, stop: Path, interval: str = "0.05", *extra: str) -> dict[str, Any]:
    return {
        "host": "loc",
        "backend": "command",
        "name": "job",
        "command": [sys.executable, str(job_script), str(stop), interval, *extra],
    }


async def _state(ctl: Controller, run_id: str, *states: str) -> bool:
    return (await ctl.get_run(run_id)).state in states


@pytest.mark.parametrize(
    ("spec", "fields"),
    [
        ({"host": "loc", "backend": "command"}, {"command"}),
        ({"host": "loc", "backend": "worker-extension", "model": "/m"}, {"dataset"}),
        ({"host": "nope", "backend": "command", "command": ["true"]}, {"host"}),
        ({"host": "loc", "model": "relative/path", "dataset": "/d.jsonl", "output_dir": "/o"}, {"model"}),
        (
            {"host": "loc", "backend": "command", "command": ["true"], "tensor_parallel_size": 0},
            {"tensor_parallel_size"},
        ),
        ({"host": "loc", "backend": "command", "command": ["true"], "shell": "rm -rf /"}, {"shell"}),
        ({"host": "loc", "backend": "command", "command": ["true"], "layers": [3, 3]}, {"layers"}),
    ],
)
async def test_invalid_specs_name_the_field_and_store_nothing(
    tmp_path: Path, local_settings: Settings, spec: dict[str, Any], fields: set[str]
) -> None:
    """The spec is validated where it comes in (parse_run_spec); what only its hosts tell, when the
    controller has it: both raise SpecInvalid naming the field."""
    async with Controller(local_settings, supervise=False) as ctl:
        await ctl.add_host(_host(tmp_path))
        with pytest.raises(SpecInvalid) as info:
            await ctl.create_run(parse_run_spec(spec))
        named = {e["field"] for e in info.value.errors}
        assert all(any(f in n for n in named) for f in fields), info.value.errors
        assert info.value.status == 422
        assert await ctl.list_runs() == []


async def test_tensor_parallel_beyond_known_gpus(tmp_path: Path, local_settings: Settings) -> None:
    async with Controller(local_settings, supervise=False) as ctl:
        await ctl.add_host(_host(tmp_path))
        await ctl.store.write(
            lambda tx: tx.conn.execute(
                "UPDATE hosts SET gpus_json='[{\"index\":0},{\"index\":1}]' WHERE name='loc'"
            )
        )
        with pytest.raises(SpecInvalid, match="tensor_parallel_size: 4 > 2 GPUs"):
            await ctl.create_run(
                parse_spec(
                    {"host": "loc", "backend": "command", "command": ["true"], "tensor_parallel_size": 4}
                )
            )


async def test_failed_launch_leaves_failed_run_with_reason(tmp_path: Path, reap: None) -> None:
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host dead\n  HostName 127.0.0.1\n  Port {free_port()}\n")
    settings = Settings(
        home=tmp_path / "home", ssh_config=cfg, known_hosts=tmp_path / "kh", connect_timeout=3
    )
    (tmp_path / "kh").write_text("")
    async with Controller(settings, supervise=False) as ctl:
        await ctl.add_host(HostCreate(name="dead", ssh="dead"))
        run_id = await ctl.create_run(parse_spec({"host": "dead", "backend": "command", "command": ["true"]}))
        run = await ctl.get_run(run_id)
        assert run.state == "failed" and run.failure_reason and "launch failed" in run.failure_reason
        assert [a.rule for a in run.alerts] == ["run_failed"]


async def test_run_completes_and_feed_replays(
    tmp_path: Path, local_settings: Settings, job_script: Path
) -> None:
    async with Controller(local_settings) as ctl:
        sub = ctl.bus.subscribe()
        await ctl.add_host(_host(tmp_path))
        run_id = await ctl.create_run(parse_spec(_cmd(job_script, tmp_path / "stop", "0.01", "20")))
        assert run_id.startswith("r-")
        await wait_for(lambda: _state(ctl, run_id, "completed"), what="completed")
        await wait_for(lambda: _lines(ctl, run_id, 41), what="all lines")
        run = await ctl.get_run(run_id)
        assert run.exit == {"code": 0, "signal": None} and run.started_at and run.ended_at
        assert [m.fields["samples_done"] for m in run.milestones if m.kind == "progress"] == list(range(20))
        assert run.progress == {"samples_done": 19}
        assert (await ctl.list_runs())[0].id == run_id
        live = []
        while not sub._queue.empty():
            item = sub._queue.get_nowait()
            if item is not None and item.run_id == run_id:
                live.append(item)
        feed = await ctl.feed_since(run_id, None)
        assert {"run", "milestone", "log"} <= {e.kind for e in feed}
        # the replay may merge log batches, but holds the same items in the same order
        assert _flat(feed)[: len(_flat(live))] == _flat(live)
        assert feed[-1].cursor >= live[-1].cursor
        assert await ctl.feed_since(run_id, feed[-1].cursor) == []
        errors = await ctl.read_log(run_id, query="plain line 1", limit=3)
        assert [e["text"] for e in errors] == ["plain line 1", "plain line 10", "plain line 11"]
        with pytest.raises(NotFound):
            await ctl.get_run("r-nope")


def _flat(events: list[Any]) -> list[Any]:
    out: list[Any] = []
    for e in events:
        if e.kind == "log":
            out.extend(("log", offset, text) for offset, text in Block(**e.data).lines())
        else:
            out.append((e.kind, e.data))
    return out


async def _lines(ctl: Controller, run_id: str, n: int) -> bool:
    return len(await ctl.read_log(run_id, limit=10000)) >= n


async def test_stop_run(tmp_path: Path, local_settings: Settings, job_script: Path) -> None:
    async with Controller(local_settings) as ctl:
        await ctl.add_host(_host(tmp_path))
        run_id = await ctl.create_run(parse_spec(_cmd(job_script, tmp_path / "stop", "0.1")))
        await wait_for(lambda: _lines(ctl, run_id, 2), what="job output")
        run = await ctl.stop_run(run_id)
        await wait_for(lambda: _state(ctl, run_id, "stopped"), what="stopped")
        assert run.id == run_id
        with pytest.raises(Conflict):
            await ctl.stop_run(run_id)
        with pytest.raises(Conflict):
            await ctl.add_host(_host(tmp_path))  # a host name is unique


SHAPE_FAIL = """\
import json, time
for i in range(3):
    print("EAGLEWATCH " + json.dumps({"kind": "shape_check_failed", "file": f"/out/hs_{i}.safetensors",
          "code": "hidden_dim_lost", "message": "hidden_states is flat [T]"}), flush=True)
time.sleep(60)
"""


async def test_shape_failure_alerts_once_and_stops(tmp_path: Path, reap: None) -> None:
    receiver = Receiver(free_port())
    receiver.start()
    script = tmp_path / "shape_fail.py"
    script.write_text(SHAPE_FAIL)
    settings = Settings(
        home=tmp_path / "home", apprise_urls=[SecretStr(f"json://127.0.0.1:{receiver.port}/")]
    )
    try:
        async with Controller(settings) as ctl:
            await ctl.add_host(_host(tmp_path))
            run_id = await ctl.create_run(
                parse_spec(
                    {
                        "host": "loc",
                        "backend": "command",
                        "command": [sys.executable, str(script)],
                        "on_shape_failure": "stop",
                    }
                )
            )
            await wait_for(lambda: _state(ctl, run_id, "stopped", "failed"), timeout=60, what="run stopped")

            async def delivered() -> bool:
                return len(receiver.bodies) >= 1 and all(
                    a.delivered for a in await ctl.list_alerts() if a.rule == "shape_check_failed"
                )

            await wait_for(delivered, what="alert delivered")
            run = await ctl.get_run(run_id)
            assert [a.rule for a in run.alerts].count("shape_check_failed") == 1  # deduplicated
            assert [m.kind for m in run.milestones].count("shape_check_failed") >= 1
        assert sum("shape_check_failed" in b["title"] for b in receiver.bodies) == 1
    finally:
        receiver.stop()


@pytest.mark.parametrize(
    ("state", "age_s", "expected", "reason"),
    [
        ("starting", 60, "failed", "launch was interrupted"),
        ("running", 0, "lost", "no record"),
        ("unknown", 0, "lost", "no record"),
    ],
)
async def test_runs_the_agent_never_heard_of(
    tmp_path: Path, local_settings: Settings, state: str, age_s: float, expected: str, reason: str
) -> None:
    """A controller that died mid-launch (or a host that lost its state) leaves runs the agent cannot find."""
    import json
    import time

    async with Controller(local_settings, supervise=False) as ctl:
        await ctl.add_host(_host(tmp_path))
        spec = {"host": "loc", "backend": "command", "command": ["true"]}
        await ctl.store.write(
            lambda tx: tx.conn.execute(
                "INSERT INTO runs(id, name, host, backend, spec_json, state, created_at, last_seq,"
                " log_offset) VALUES ('r-ghost','g','loc','command',?,?,?,0,0)",
                (json.dumps(spec), state, time.time() - age_s),
            )
        )
    async with Controller(local_settings) as ctl:
        await wait_for(lambda: _state(ctl, "r-ghost", expected), what=f"run {expected}")
        run = await ctl.get_run("r-ghost")
        assert run.failure_reason and reason in run.failure_reason


async def test_recently_ended_run_catches_up_missing_tail(
    tmp_path: Path, local_settings: Settings, job_script: Path
) -> None:
    """The link dropped after the final state but before the last lines: the next connection fetches them."""
    async with Controller(local_settings) as ctl:
        await ctl.add_host(_host(tmp_path))
        run_id = await ctl.create_run(parse_spec(_cmd(job_script, tmp_path / "stop", "0.01", "10")))
        await wait_for(lambda: _state(ctl, run_id, "completed"), what="completed")
        await wait_for(lambda: _lines(ctl, run_id, 21), what="all lines")
        full = await ctl.read_log(run_id)
    cut = full[15]["offset"]

    def lose_tail(tx: Any) -> None:
        tx.conn.execute("DELETE FROM log_blocks WHERE run_id=?", (run_id,))
        tx.conn.execute("UPDATE runs SET log_offset=0 WHERE id=?", (run_id,))
        head = [(ln["offset"], ln["text"]) for ln in full[:15]]
        crud.add_log_block(tx=tx, run_id=run_id, block=_block(head, cut))

    async with Controller(local_settings, supervise=False) as ctl:
        await ctl.store.write(lose_tail)
        assert len(await ctl.read_log(run_id)) == 15
    async with Controller(local_settings) as ctl:
        await wait_for(lambda: _lines(ctl, run_id, 21), what="tail fetched again")
        assert await ctl.read_log(run_id) == full
