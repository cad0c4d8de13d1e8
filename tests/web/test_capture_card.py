"""The run page's capture card: built from milestones (pure table), rendered server-side from a real store."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from controller import crud
from controller.alerts import AlertPolicy
from controller.lifecycle import RunEvent
from controller.service import Controller
from controller.store import Tx
from web.capture_card import CaptureCard, capture_card, sharded_capture_card
from web.filters import duration, size

SPEC = {
    "host": "h",
    "backend": "worker-extension",
    "model": "/models/dsv3",
    "dataset": "/d",
    "output_dir": "/o",
}
ENGINE = ("engine_config", {"vllm": "0.26.0", "platform": "cuda"})
CONFIGURED = (
    "capture_configured",
    {"layers": [2, 30, 58, 61], "convention": "input", "hidden_size": 7168, "dtype": "bfloat16"},
)


@dataclass
class M:
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


def _card(spec: dict[str, Any], *ms: tuple[str, dict[str, Any]]) -> CaptureCard | None:
    return capture_card(spec, [M(k, f) for k, f in ms])


def test_running_then_completed() -> None:
    running = _card(
        SPEC,
        ENGINE,
        CONFIGURED,
        ("batch_captured", {"tokens": 100}),
        ("progress", {"files_written": 2, "bytes_written": 4096}),
        ("batch_captured", {"tokens": 50}),
        ("progress", {"files_written": 3, "bytes_written": 6144}),
    )
    assert running == CaptureCard(
        "/models/dsv3",
        "0.26.0",
        [2, 30, 58, 61],
        "input",
        7168,
        "bfloat16",
        150,
        3,
        6144,
        final=False,
        expected_shape="[T, 4, 7168]",
    )
    done = _card(
        SPEC,
        ENGINE,
        CONFIGURED,
        ("batch_captured", {"tokens": 150}),
        ("completed", {"tokens": 900, "files": 9}),
    )
    assert done is not None and (done.tokens, done.files, done.final) == (
        900,
        9,
        True,
    )  # resumed samples count


@pytest.mark.parametrize(
    ("spec", "ms"),
    [
        ({**SPEC, "backend": "command", "command": ["x"]}, [ENGINE]),  # a watched vLLM: its log says no more
        (SPEC, []),  # nothing reported yet
        (SPEC, [("progress", {"files_written": 1})]),
    ],
)
def test_no_card(spec: dict[str, Any], ms: list[tuple[str, dict[str, Any]]]) -> None:
    assert _card(spec, *ms) is None


def test_forecast_free_space_and_eta() -> None:
    forecast = ("forecast", {"bytes": 900, "free_bytes": 500, "fits": False, "estimated": False})
    card = _card(SPEC, forecast)  # refused before any engine: the card still says why
    assert card is not None and (card.forecast_bytes, card.free_bytes, card.fits) == (900, 500, False)
    card = _card(SPEC, forecast, ENGINE, ("progress", {"free_bytes": 400, "eta_s": 30.5}))
    assert card is not None and (card.free_bytes, card.eta_s) == (400, 30.5)
    card = _card(SPEC, forecast, ENGINE, ("progress", {"eta_s": 30.5}), ("completed", {"tokens": 1}))
    assert card is not None and card.eta_s is None


def test_odd_fields_are_ignored() -> None:
    card = _card(SPEC, ("capture_configured", {"layers": [2, "x", True], "hidden_size": "7168", "dtype": 3}))
    assert card is not None and card.layers == [2] and card.hidden_size is None and card.dtype is None


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59.6, "1m 00s"), (125, "2m 05s"), (3 * 3600 + 20 * 60, "3h 20m"), (None, "?")],
)
def test_duration(seconds: float | None, text: str) -> None:
    assert duration(seconds) == text


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0 B"), (1023, "1,023 B"), (1536, "1.5 KiB"), (3 * 2**30, "3.0 GiB")]
)
def test_size(n: int, text: str) -> None:
    assert size(n) == text


def _milestone(seq: int, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"seq": seq, "ts": 1000.0 + seq, "type": "milestone", "kind": kind, "line": seq, "rank": None,
            "fields": fields, "text": ""}  # fmt: skip


def _store_run(tx: Tx) -> None:
    quiet = AlertPolicy(cooldown_s=0, deliver=False)
    tx.conn.execute(
        "INSERT INTO hosts(name, ssh, python, created_at, gpus_json) VALUES ('h','h','python3',0,'[]')"
    )
    tx.conn.execute(
        "INSERT INTO runs(id, name, host, backend, model, spec_json, state, created_at, last_seq, log_offset)"
        " VALUES ('r-1','run','h','worker-extension','/models/dsv3',?,'pending',?,0,0)",
        (json.dumps(SPEC), tx.now),
    )
    crud.transition(tx=tx, run_id="r-1", event=RunEvent.LAUNCH, policy=quiet)
    crud.transition(tx=tx, run_id="r-1", event=RunEvent.LAUNCHED, policy=quiet)
    events = [
        _milestone(
            1, "forecast", {"bytes": 5 * 2**30, "free_bytes": 2**40, "fits": True, "estimated": False}
        ),
        _milestone(2, *ENGINE),
        _milestone(3, *CONFIGURED),
        _milestone(4, "batch_captured", {"tokens": 1234}),
        _milestone(
            5, "progress", {"files_written": 8, "bytes_written": 3 * 2**30, "free_bytes": 2**39, "eta_s": 125}
        ),
    ]
    crud.apply_events(tx=tx, run_id="r-1", events=events, policy=quiet)


async def test_run_page_shows_the_card(client: httpx.AsyncClient, ctl: Controller) -> None:
    await ctl.store.write(_store_run)
    html = (await client.get("/runs/r-1")).text
    assert 'id="capture-card"' in html and "so far" in html
    shown = {"vllm": "0.26.0", "hidden_size": "7,168", "dtype": "bfloat16", "tokens": "1,234", "files": "8",
             "bytes": "3.0 GiB", "forecast": "5.0 GiB to write", "free": "512.0 GiB",
             "eta": "2m 05s"}  # fmt: skip
    for key, text in shown.items():
        assert f'data-card="{key}">{text}<' in html, key
    assert (
        'data-card="layers">2, 30, 58, 61 <span class="muted small">(input: the residual stream entering'
        in html
    )


@dataclass
class SM:
    kind: str
    fields: dict[str, Any]
    shard: int


def test_a_sharded_runs_card_sums_its_shards() -> None:
    def shard(i: int, *ms: tuple[str, dict[str, Any]]) -> list[SM]:
        return [SM(k, f, i) for k, f in (ENGINE, CONFIGURED, *ms)]

    running = sharded_capture_card(
        SPEC,
        shard(0, ("batch_captured", {"tokens": 100}), ("progress", {"files_written": 2, "bytes_written": 40,
              "eta_s": 5.0, "free_bytes": 900})) +
        shard(1, ("batch_captured", {"tokens": 30}), ("progress", {"files_written": 1, "bytes_written": 10,
              "eta_s": 12.5, "free_bytes": 700})),
    )  # fmt: skip
    assert running is not None and (running.tokens, running.files, running.bytes) == (130, 3, 50)
    assert running.eta_s == 12.5 and running.free_bytes == 700 and not running.final
    done = sharded_capture_card(
        SPEC,
        shard(0, ("completed", {"tokens": 120, "files": 3}))
        + shard(1, ("completed", {"tokens": 80, "files": 4})),
    )
    assert done is not None and done.final and (done.tokens, done.files, done.eta_s) == (200, 7, None)
    half = sharded_capture_card(SPEC, shard(0, ("completed", {"tokens": 120, "files": 3})) + shard(1))
    assert half is not None and not half.final and half.layers == [2, 30, 58, 61]


def test_shapes_read_beside_the_configured_ones() -> None:
    """The latest check's shapes, token axis as T; a dropped layer differs from what was configured."""
    shapes = {"token_ids": [16], "hidden_states": [16, 3, 7168]}
    card = _card(SPEC, CONFIGURED, ("shape_check_failed", {"file": "hs_0.safetensors", "shapes": shapes}))
    assert card is not None and card.shapes == {"token_ids": "[T]", "hidden_states": "[T, 3, 7168]"}
    assert card.expected_shape == "[T, 4, 7168]" and card.shape_differs
    good = {"token_ids": [16], "hidden_states": [16, 4, 7168]}
    card = _card(SPEC, CONFIGURED, ("shape_check_passed", {"file": "hs_1.safetensors", "shapes": good}))
    assert card is not None and not card.shape_differs
