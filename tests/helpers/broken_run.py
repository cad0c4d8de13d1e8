"""Seed a controller database through the controller's own ingest: the demo's broken run (a job that exited 0
and completed although every capture file lost its last layer, ``inject_fault: drop_layer``), or a run whose
journal the agent's own milestone engine and final-state decision made from a real log."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from agent.logs.splitter import LineSplitter
from agent.milestones.engine import MilestoneEngine, load_rules
from agent.runs.summary import RunSummary, final_state
from controller import crud
from controller.alerts import AlertPolicy
from controller.bus import Bus
from controller.lifecycle import RunEvent
from controller.store import Store, Tx

MESSAGE = "layer count mismatch: hidden_states has 3 layers, expected 4 (final layer dropped?)"


def journal(out_dir: str, files: int, bad: set[int]) -> list[dict[str, Any]]:
    """The agent's journal of such a run: a check event and a milestone per file, completion, exit 0."""
    events: list[dict[str, Any]] = []

    def add(ev: dict[str, Any]) -> None:
        events.append({"seq": len(events) + 1, "ts": 1000.0 + len(events), **ev})

    add({"type": "state", "state": "running"})
    for i in range(files):
        name = f"hs_{i}.safetensors"
        problems = (
            [{"code": "layer_count_mismatch", "file": f"{out_dir}/{name}", "message": MESSAGE}]
            if i in bad
            else []
        )
        add(
            {"type": "check", "file": name, "ok": not problems, "format": "safetensors", "problems": problems}
        )
        kind = "shape_check_failed" if problems else "shape_check_passed"
        fields: dict[str, Any] = {"file": name, "index": i}
        if problems:
            fields.update(code="layer_count_mismatch", message=MESSAGE)
        add({"type": "milestone", "kind": kind, "line": i + 1, "rank": None, "fields": fields, "text": kind})
    done = {"samples": files, "files": files, "tokens": 40 * files, "seconds": 12.5}
    add(
        {
            "type": "milestone",
            "kind": "completed",
            "line": files + 1,
            "rank": None,
            "fields": done,
            "text": "done",
        }
    )
    add({"type": "state", "state": "completed", "reason": "exit code 0", "exit": {"code": 0, "signal": None}})
    return events


def journal_of_log(log: bytes, exit_code: int) -> list[dict[str, Any]]:
    """What the agent journals for a job that printed ``log`` and exited with ``exit_code``."""
    sp, eng = LineSplitter(), MilestoneEngine(load_rules())
    events: list[dict[str, Any]] = [{"type": "state", "state": "running"}]
    for i, ln in enumerate(sp.feed(log) + sp.flush(), 1):
        events += [{"type": "milestone", **m.to_dict()} for m in eng.feed(ln.text, i)]
    events += [{"type": "milestone", **m.to_dict()} for m in eng.flush()]
    exit_rec = {"code": exit_code, "signal": None}
    state, reason = final_state(exit_rec, None, RunSummary.from_events(events), "worker-extension")
    events.append({"type": "state", "state": state, "reason": reason, "exit": exit_rec})
    return [{"seq": n, "ts": 1000.0 + n, **ev} for n, ev in enumerate(events, 1)]


def seed(
    db: Path,
    out_dir: str,
    *,
    run_id: str = "r-broken",
    files: int = 24,
    bad: set[int] | None = None,
    events: list[dict[str, Any]] | None = None,
) -> str:
    """Write the host ``local`` and the run ``run_id`` (alerts raised as a live controller would) with the
    broken run's journal, or with ``events``."""
    bad = set(range(files)) if bad is None else bad
    spec = {
        "name": "demo-broken", "host": "local", "backend": "worker-extension", "model": "/models/tiny-llama",
        "output_dir": out_dir, "inject_fault": "drop_layer", "on_shape_failure": "alert",
    }  # fmt: skip

    def write(tx: Tx) -> None:
        tx.conn.execute(
            "INSERT INTO hosts(name, ssh, python, created_at, gpus_json)"
            " VALUES ('local','local','python3',0,'[]') ON CONFLICT DO NOTHING"
        )
        crud.insert_run(
            tx=tx, run_id=run_id, name="demo-broken", host="local", backend="worker-extension",
            model="/models/tiny-llama", spec_json=json.dumps(spec),
        )  # fmt: skip
        policy = AlertPolicy(cooldown_s=600, deliver=False)
        crud.transition(tx=tx, run_id=run_id, event=RunEvent.LAUNCH, policy=policy)
        crud.transition(tx=tx, run_id=run_id, event=RunEvent.LAUNCHED, policy=policy)
        evs = events if events is not None else journal(out_dir, files, bad)
        crud.apply_events(tx=tx, run_id=run_id, events=evs, policy=policy)

    async def main() -> None:
        store = Store(db, Bus())
        await store.open()
        try:
            await store.write(write)
        finally:
            await store.close()

    asyncio.run(main())
    return run_id
