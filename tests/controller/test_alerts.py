"""Alert rules (tables), dedupe with cooldown, delivery through apprise json:// to a real HTTP receiver."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from controller import alerts, crud, queries
from controller.alerts import AlertPolicy
from controller.bus import Bus
from controller.service import OutboxWorker
from controller.settings import Settings
from controller.store import Store, Tx
from tests.helpers.sshd import free_port

RUN = {"id": "r-1", "name": "llama", "host": "gpu1", "state": "running"}


@pytest.mark.parametrize(
    ("event", "rules"),
    [
        (
            {"type": "milestone", "kind": "shape_check_failed", "fields": {"message": "flat"}},
            ["shape_check_failed"],
        ),
        ({"type": "milestone", "kind": "error", "fields": {"class": "oom"}, "text": "CUDA OOM"}, ["error"]),
        ({"type": "milestone", "kind": "progress", "fields": {}}, []),
        (
            {"type": "milestone", "kind": "progress", "fields": {"disk_low": True, "free_bytes": 2**30}},
            ["disk_low"],
        ),
        ({"type": "milestone", "kind": "progress", "fields": {"disk_low": False, "free_bytes": 2**40}}, []),
        ({"type": "milestone", "kind": "warning", "fields": {}}, []),
        (
            {
                "type": "check",
                "ok": False,
                "file": "hs_0",
                "problems": [{"code": "all_zero", "message": "z"}],
            },
            ["shape_check_failed"],
        ),
        ({"type": "check", "ok": True, "file": "hs_0", "problems": []}, []),
        ({"type": "state", "state": "failed", "reason": "exit 1"}, ["run_failed"]),
        ({"type": "state", "state": "lost"}, ["run_lost"]),
        ({"type": "state", "state": "completed"}, []),
    ],
)
def test_rules_for_event(event: dict[str, Any], rules: list[str]) -> None:
    drafts = alerts.rules_for_event(RUN, event)
    assert [d.rule for d in drafts] == rules
    assert all(d.run_id == "r-1" and d.host == "gpu1" and "llama" in d.message for d in drafts)


def test_disk_low_alert_says_how_much_is_free() -> None:
    ev = {"type": "milestone", "kind": "progress", "fields": {"disk_low": True, "free_bytes": 3 * 2**30}}
    (d,) = alerts.rules_for_event(RUN, ev)
    assert d.severity == "warning" and "3.0 GiB free" in d.message and d.dedupe_key == "run:r-1:disk_low"


def test_layer_collapse_alert_names_layer_and_file() -> None:
    collapse = {
        "layer": 4,
        "what": "collapse",
        "message": "layer 4: RMS fell to 0 from 1.2",
        "file": "hs_7.safetensors",
    }
    ev = {"type": "milestone", "kind": "progress", "fields": {"layer_collapse": [collapse], "disk_low": True}}
    drafts = alerts.rules_for_event(RUN, ev)
    assert [d.rule for d in drafts] == ["disk_low", "layer_collapse"]
    assert (
        drafts[1].severity == "critical" and "hs_7.safetensors: layer 4: RMS fell to 0" in drafts[1].message
    )
    assert (
        alerts.rules_for_event(
            RUN, {"type": "milestone", "kind": "progress", "fields": {"layer_collapse": []}}
        )
        == []
    )


def test_canary_mismatch_alert() -> None:
    bad = {"samples": 2, "max_rel_diff": 0.25, "ok": False, "tolerance": 0.001}
    (d,) = alerts.rules_for_event(RUN, {"type": "milestone", "kind": "canary_checked", "fields": bad})
    assert d.rule == "canary_mismatch" and d.severity == "critical" and "up to 0.25" in d.message
    good = {**bad, "max_rel_diff": 1e-6, "ok": True}
    assert alerts.rules_for_event(RUN, {"type": "milestone", "kind": "canary_checked", "fields": good}) == []


def test_error_alert_names_class() -> None:
    (d,) = alerts.rules_for_event(
        RUN, {"type": "milestone", "kind": "error", "fields": {"class": "nccl"}, "text": "NCCL error"}
    )
    assert "nccl" in d.message and d.dedupe_key == "run:r-1:error:nccl"


def test_error_alert_of_a_wrapper_leads_with_its_root_cause() -> None:
    """The agent marks a wrapper error with the failure's root cause: the alert names that first."""
    wrapper = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    fields = {
        "class": "engine_failed",
        "root_cause": "AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers.",
        "root_cause_class": "traceback",
    }
    (d,) = alerts.rules_for_event(
        RUN, {"type": "milestone", "kind": "error", "fields": fields, "text": wrapper}
    )
    assert d.message.index("Not enough allowed NUMA nodes") < d.message.index("Engine core initialization")


@pytest.mark.parametrize(
    ("last_progress_ago", "interval", "state", "fires"),
    [
        (100, 10, "running", True),
        (30, 10, "running", False),
        (100, 10, "completed", False),
        (100, None, "running", False),
        (61, 1, "running", True),
        (59, 1, "running", False),
    ],
)
def test_stall(last_progress_ago: float, interval: float | None, state: str, fires: bool) -> None:
    now = 10_000.0
    run = {
        **RUN,
        "state": state,
        "last_progress_at": now - last_progress_ago,
        "progress_interval_s": interval,
    }
    d = alerts.stall(run, now, factor=5, min_s=60)
    assert (d is not None) == fires
    if d:
        assert d.rule == "stall" and d.run_id == "r-1"


def test_host_unreachable_after_minutes() -> None:
    assert alerts.host_unreachable("gpu1", None, 1000, 5) is None
    assert alerts.host_unreachable("gpu1", 1000 - 299, 1000, 5) is None
    d = alerts.host_unreachable("gpu1", 1000 - 301, 1000, 5)
    assert d is not None and d.host == "gpu1" and d.dedupe_key == "host:gpu1:host_unreachable"


class Receiver:
    """A real HTTP server recording the JSON bodies posted to it; can go down and come back on its port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.bodies: list[dict[str, Any]] = []
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            assert self.thread is not None
            self.thread.join()
            self.server = None


@pytest.fixture
def receiver() -> Any:
    r = Receiver(free_port())
    r.start()
    yield r
    r.stop()


def _settings(tmp_path: Path, port: int) -> Settings:
    return Settings(home=tmp_path, apprise_urls=[SecretStr(f"json://127.0.0.1:{port}/hook")], cooldown_s=600)


async def _raise(store: Store, draft: alerts.AlertDraft) -> int | None:
    return await store.write(
        lambda tx: crud.raise_alert(tx=tx, draft=draft, policy=AlertPolicy(cooldown_s=600, deliver=True))
    )


async def test_delivered_once_through_apprise_json(tmp_path: Path, receiver: Receiver) -> None:
    settings = _settings(tmp_path, receiver.port)
    store = Store(settings.database, Bus())
    await store.open()
    try:
        draft = alerts.AlertDraft("shape_check_failed", "critical", "llama: hidden_dim_lost", "r-1", "gpu1")
        first = await _raise(store, draft)
        assert first is not None
        assert await _raise(store, draft) is None  # same run and problem within the cooldown: deduplicated
        worker = OutboxWorker(settings, store)
        assert await worker.deliver_due() == 1
        assert await worker.deliver_due() == 0
        assert len(receiver.bodies) == 1
        body = receiver.bodies[0]
        assert "hidden_dim_lost" in body["message"] and "shape_check_failed" in body["title"]
        assert (await store.read(queries.get_alert, first)).delivered is True
    finally:
        await store.close()


async def test_outbox_survives_receiver_down_and_restart(tmp_path: Path, receiver: Receiver) -> None:
    settings = _settings(tmp_path, receiver.port)
    receiver.stop()
    store = Store(settings.database, Bus())
    await store.open()
    try:
        alert_id = await _raise(
            store, alerts.AlertDraft("run_failed", "error", "llama failed", "r-1", "gpu1")
        )
        assert alert_id is not None
        assert await OutboxWorker(settings, store).deliver_due() == 0
        row = await store.read(lambda c: dict(c.execute("SELECT * FROM outbox").fetchone()))
        assert row["attempts"] == 1 and row["done"] == 0 and row["last_error"]
    finally:
        await store.close()  # the controller goes away with the alert undelivered
    receiver.start()
    store = Store(settings.database, Bus())  # a restarted controller
    await store.open()
    try:
        await store.write(
            lambda tx: tx.conn.execute("UPDATE outbox SET next_attempt_at=0")
        )  # skip the backoff
        assert await OutboxWorker(settings, store).deliver_due() == 1
        assert [b["message"] for b in receiver.bodies] == ["llama failed"]
        assert (await store.read(queries.get_alert, alert_id)).delivered is True
    finally:
        await store.close()


async def test_backoff_grows_and_muted_alerts_are_not_sent(tmp_path: Path, receiver: Receiver) -> None:
    settings = _settings(tmp_path, receiver.port)
    receiver.stop()
    store = Store(settings.database, Bus())
    await store.open()
    try:
        worker = OutboxWorker(settings, store)
        await _raise(store, alerts.AlertDraft("stall", "warning", "slow", "r-2", "gpu1"))
        delays = []
        for _ in range(3):
            await worker.deliver_due()
            row = await store.read(lambda c: dict(c.execute("SELECT * FROM outbox").fetchone()))
            delays.append(row["next_attempt_at"] - time.time())
            await store.write(lambda tx: tx.conn.execute("UPDATE outbox SET next_attempt_at=0"))
        assert delays[0] < delays[2] and row["attempts"] == 3

        def mute(tx: Tx) -> None:
            tx.conn.execute("UPDATE alerts SET muted=1")

        await store.write(mute)
        receiver.start()
        assert await worker.deliver_due() == 0 and receiver.bodies == []
    finally:
        await store.close()
