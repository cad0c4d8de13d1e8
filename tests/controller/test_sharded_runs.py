"""Sharded runs through the real sshd and the real vLLM CPU engine (tiny Llama fp32), seen as one run.

One module-scoped scenario (engine starts are expensive): two host entries (two SSH aliases to this
machine, one agent) carry a 2-shard run; shard 1's engine is killed early, which fails only shard 1 while
shard 0 goes on; ``resume --shard 1`` completes it and the last shard merges manifest.json.  Then a
2-shard run stopped at once. The files are compared with the session's one-job capture of the same spec
(tests/conftest.py ``sharded_whole``). Every assertion below reads that scenario's results.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.spec import parse_spec
from controller.models import HostCreate, RunDetail
from controller.service import Controller
from controller.settings import Settings
from tests.cli.test_commands import cli
from tests.controller.conftest import wait_for
from tests.extract.jobrun import IN_PROCESS_ENGINE
from tests.extract.jobrun import SHARD_LENGTHS as LENGTHS
from tests.extract.reference import same_capture
from tests.helpers.sshd import SSHD, kill_tree_matching

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
#: the engine core in the job's process (jobrun.IN_PROCESS_ENGINE): this test's subject is not vLLM's layout
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    **IN_PROCESS_ENGINE,
}


def _spec(tmp: Path, common: dict[str, Any], out: str, **more: Any) -> dict[str, Any]:
    return {
        "name": "tiny", "backend": "worker-extension", **common, "output_dir": str(tmp / out), "env": CPU_ENV,
        **more,
    }  # fmt: skip


async def _ended(ctl: Controller, run_id: str) -> RunDetail | None:
    run = await ctl.get_run(run_id)
    return run if run.state in ("completed", "failed", "stopped", "lost") else None


async def _scenario(tmp: Path, settings: Settings, common: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {"tmp": tmp}
    async with Controller(settings) as ctl:
        for name, alias in (("h1", "eaglehost"), ("h2", "eaglehost2")):
            await ctl.add_host(
                HostCreate(name=name, ssh=alias, python=sys.executable, state_dir=str(tmp / "agent"))
            )
        run_id = await ctl.create_run(parse_spec(_spec(tmp, common, "sharded", host=["h1", "h2"], shards=2)))
        res["id"] = run_id
        job1 = f"{run_id}-s1"

        async def engine_configured() -> Any:
            kinds = [m.kind for m in (await ctl.get_run(run_id)).milestones if m.shard == 1]
            return "engine_config" in kinds

        await wait_for(engine_configured, timeout=180, what="shard 1's engine_config")
        pid = (
            await ctl.store.read(lambda c: c.execute("SELECT pid FROM runs WHERE id=?", (job1,)).fetchone())
        )[0]
        os.killpg(pid, signal.SIGKILL)  # the job and its engine core, as an OOM killer would

        async def shard1_failed() -> Any:
            run = await ctl.get_run(run_id)
            return run if run.shards and run.shards[1].state == "failed" else None

        res["after_kill"] = await wait_for(shard1_failed, timeout=60, what="shard 1 failed")
        res["resumed_id"] = await ctl.resume_run(run_id, 1)
        res["final"] = await wait_for(lambda: _ended(ctl, run_id), timeout=400, what="the sharded run to end")
        res["card"] = await ctl.run_card(run_id)
        res["db_milestones"] = await ctl.store.read(
            lambda c: [tuple(r) for r in c.execute("SELECT run_id, seq, kind FROM milestones")]
        )
        stopped = await ctl.create_run(parse_spec(_spec(tmp, common, "stopped", host=["h1", "h2"], shards=2)))
        await wait_for(lambda: _launched(ctl, stopped), timeout=60, what="both shards running")
        await ctl.stop_run(stopped)
        res["stopped"] = await wait_for(
            lambda: _ended(ctl, stopped), timeout=60, what="the stopped run to end"
        )
        res["listed"] = [r.id for r in await ctl.list_runs()]
    return res


async def _launched(ctl: Controller, run_id: str) -> bool:
    run = await ctl.get_run(run_id)
    return bool(run.shards) and all(s.state == "running" for s in run.shards or [])


@pytest.fixture(scope="module")
def scenario(
    sharded_whole: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sharded-runs")
    sshd = SSHD.start(tmp / "sshd")
    # a second host entry: another alias of the same server, as two names for one machine would be
    sshd.ssh_config.write_text(
        sshd.ssh_config.read_text() + sshd.ssh_config.read_text().replace("Host eaglehost", "Host eaglehost2")
    )
    settings = Settings(
        home=tmp / "home", known_hosts=sshd.known_hosts, ssh_config=sshd.ssh_config,
        remote_base=str(tmp / "remote"), reconnect_initial_s=0.1, reconnect_max_s=0.5, connect_timeout=5,
        keepalive_interval=2,
    )  # fmt: skip
    try:
        res = asyncio.run(_scenario(tmp, settings, sharded_whole["common"]))
        yield {**res, "whole": sharded_whole["out"]}
    finally:
        kill_tree_matching(str(tmp) + "/")
        sshd.stop()


def test_a_killed_shard_fails_alone_and_resumes_into_the_same_run(scenario: dict[str, Any]) -> None:
    after_kill: RunDetail = scenario["after_kill"]
    assert after_kill.state not in ("failed", "completed")  # shard 0 goes on
    assert after_kill.shards is not None and after_kill.shards[0].state in (
        "starting",
        "running",
        "completed",
    )
    failed = [a for a in after_kill.alerts if a.rule == "run_failed"]
    assert failed and "shard 1/2" in failed[0].message, after_kill.alerts
    assert scenario["resumed_id"] == scenario["id"]
    final: RunDetail = scenario["final"]
    assert final.state == "completed", final.failure_reason
    # the verdict judges each shard's latest attempt; the killed attempt's alert stays in the run's list
    assert final.verdict == "ok", final.verdict_text
    assert [a.run_id for a in final.alerts if a.rule == "run_failed"] == [f"{final.id}-s1"]
    assert final.shards is not None and [(s.index, s.host, s.state, s.attempts) for s in final.shards] == [
        (0, "h1", "completed", 1),
        (1, "h2", "completed", 2),
    ]
    assert final.progress is not None and final.progress["samples_done"] == len(LENGTHS)
    assert final.host == "h1,h2" and final.spec["shards"] == 2 and final.spec["host"] == ["h1", "h2"]


def test_both_shards_milestones_are_stored_once(scenario: dict[str, Any]) -> None:
    final: RunDetail = scenario["final"]
    rows = scenario["db_milestones"]
    assert len(rows) == len(set(rows))
    run_id = final.id
    jobs = {f"{run_id}-s0", f"{run_id}-s1", f"{run_id}-s1-a2"}
    assert {r[0] for r in rows} == jobs
    journal = Path(scenario["tmp"]) / "agent" / "runs"
    for job in jobs:
        lines = [json.loads(x) for x in (journal / job / "events.jsonl").read_text().splitlines()]
        want = sorted((e["seq"], e["kind"]) for e in lines if e.get("type") == "milestone")
        assert sorted((s, k) for r, s, k in rows if r == job) == want, job
    completed = [m.shard for m in final.milestones if m.kind == "completed"]
    assert sorted(completed) == [0, 1]
    assert {m.shard for m in final.milestones} == {0, 1}
    assert scenario["listed"].count(run_id) == 1 and not any(
        i.startswith(run_id + "-") for i in scenario["listed"]
    )


def test_the_merged_manifest_and_files_equal_the_one_shard_run(scenario: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file

    card = scenario["card"]
    assert [(s["start"], s["end"], s["samples_written"]) for s in card["shards"]] == [(0, 3, 3), (3, 7, 4)]
    assert card["samples_written"] == len(LENGTHS) and card["tokens_total"] == sum(LENGTHS)
    whole, sharded = scenario["whole"], Path(scenario["tmp"]) / "sharded"
    names = sorted(p.name for p in whole.glob("hs_*.safetensors"))
    assert names == sorted(p.name for p in sharded.glob("hs_*.safetensors")) and len(names) == len(LENGTHS)
    for name in names:
        a, b = load_file(str(whole / name)), load_file(str(sharded / name))
        assert same_capture(b["hidden_states"], a["hidden_states"]), name
        assert torch.equal(a["token_ids"], b["token_ids"]), name
    one = json.loads((whole / "manifest.json").read_text())
    merged = json.loads((sharded / "manifest.json").read_text())
    assert merged["samples"] == one["samples"] and merged["tokens_total"] == one["tokens_total"]


def test_stop_stops_every_shard(scenario: dict[str, Any]) -> None:
    stopped: RunDetail = scenario["stopped"]
    assert stopped.state == "stopped" and stopped.verdict == "ok"
    assert stopped.shards is not None and [s.state for s in stopped.shards] == ["stopped", "stopped"]


def test_cli_shows_the_shard_table_and_names_a_missing_shard(scenario: dict[str, Any]) -> None:
    tmp, run_id = Path(scenario["tmp"]), scenario["id"]
    shown = cli(tmp, "runs", "show", run_id, "--no-refresh")
    assert shown.returncode == 0, shown.stderr
    assert "shard 1  h2" in shown.stdout and "attempt 2" in shown.stdout
    as_json = json.loads(cli(tmp, "runs", "show", run_id, "--json", "--no-refresh").stdout)
    assert [s["job_id"] for s in as_json["shards"]] == [f"{run_id}-s0", f"{run_id}-s1-a2"]
    logs = cli(tmp, "runs", "logs", run_id)
    assert logs.returncode == 0 and f"{run_id}-s1-a2" in logs.stderr
    missing = cli(tmp, "runs", "resume", run_id, "--shard", "7")
    assert missing.returncode == 1 and "has no shard 7" in missing.stderr
    done = cli(tmp, "runs", "resume", run_id, "--shard", "0")
    assert done.returncode == 1 and "shard 0 of run" in done.stderr and "completed" in done.stderr
    spec = tmp / "cli-spec.json"
    spec.write_text(json.dumps({"model": "/m", "dataset": "/d.jsonl", "output_dir": "/o"}))
    refused = cli(tmp, "runs", "start", "--host", "h1", "--host", "h2", "--shards", "1", "--spec", str(spec))
    assert refused.returncode == 2 and "shards is 1 but 2 hosts are given" in refused.stderr, refused.stderr
