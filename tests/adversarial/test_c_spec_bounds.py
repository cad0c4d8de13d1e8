"""Adversarial specs, bodies and forms (fixed seeds): bounded inputs, strict types, no silent loss.

Families: (1) any spec the model accepts travels in one protocol line and the daemon's view accepts it;
(2) numbers are never coerced; (3) a body over the limit is 413 whatever its framing, one at the limit
is read;
(4) the form never drops an env line silently and never coerces number text laxly.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from agent import limits
from agent.protocol import MAX_LINE_BYTES, decode_request, encode
from agent.runs.jobspec import JobSpec
from agent.spec import parse_spec
from controller.service import Controller
from tests.web.conftest import settings_for
from web import forms
from web.app import create_app

# Characters whose JSON form is longest (6-byte escapes, 4-byte UTF-8), plus plain and shell-ish ones.
ALPHABET = ["a", "Z", "0", " ", ";", "$", "\x01", "\x1f", '"', "\\", "é", "\u2028", "\U0001f600", "\ud800"]


def _text(rng: random.Random, longest: int, bad: bool = False) -> str:
    """A string of up to ``longest`` characters (one past it when ``bad``), repeating a short random piece."""
    n = longest + 1 if bad else rng.choice([0, 1, 8, longest // 2, longest])
    piece = "".join(rng.choice(ALPHABET[:-1]) for _ in range(7))
    return (piece * (n // len(piece) + 1))[:n]


def _number(rng: random.Random, bad: bool) -> Any:
    if bad:
        return rng.choice([2**63, 2**64, -1, 0, "8", True, False, 8.0, 1e300])
    return rng.choice([1, 2, 64])


def _spec(rng: random.Random) -> dict[str, Any]:
    """A spec whose fields are each valid (sometimes at their bound) or, one time in eight, wrong."""

    def bad() -> bool:
        return rng.random() < 0.125

    spec: dict[str, Any] = {"host": "h1"}
    if rng.random() < 0.5:
        spec["backend"] = "command"
        program = rng.choice(["sh -c 'x'", ""]) if bad() else rng.choice(["true", "/bin/echo"])
        spec["command"] = [program] + [
            _text(rng, limits.MAX_ARG_CHARS, bad()) for _ in range(rng.choice([0, 2, 30]))
        ]
    else:
        spec.update(
            model="/m", dataset="/d.jsonl", output_dir="/" + _text(rng, limits.MAX_PATH_CHARS - 1, bad())
        )
        options = ["--dtype float32", "--x y=1"] if bad() else ["--dtype", "--x=a b", "-1", "a;b"]
        spec["vllm_args"] = [
            rng.choice(options) for _ in range(limits.MAX_ARGS + 1 if bad() else rng.choice([0, 3]))
        ]
        ids = [2**63, -1, True] if bad() else [0, 2, 4, limits.MAX_LAYER_ID]
        spec["layers"] = sorted({rng.choice(ids) for _ in range(3)}, key=str)
    for key in ("tensor_parallel_size", "max_samples", "seq_len", "batch_size"):
        if rng.random() < 0.5:
            spec[key] = _number(rng, bad())
    if rng.random() < 0.5:
        spec["expect"] = {"layers": _number(rng, bad()), "hidden_size": _number(rng, bad())}
    count = limits.MAX_ENV_VARS + 1 if bad() else rng.choice([0, 4, 20, limits.MAX_ENV_VARS])
    spec["env"] = {f"V{i}": _text(rng, limits.MAX_ENV_VALUE_CHARS // 16, bad()) for i in range(count)}
    spec["rules"] = [{"name": _text(rng, 2048)} for _ in range(rng.choice([0, 2, 50]))]
    return spec


def test_any_accepted_spec_fits_one_line_and_the_daemon_agrees() -> None:
    rng = random.Random(4011)
    accepted = refused = 0
    started = time.monotonic()
    for _ in range(120):
        raw = _spec(rng)
        try:
            dumped = parse_spec(raw).model_dump(mode="json")
        except ValidationError as exc:
            refused += 1
            assert all(e["msg"] for e in exc.errors())
            continue
        accepted += 1
        line = encode({"id": 2**63, "op": "launch", "run": "r" * 64, "spec": dumped})
        assert len(line) <= MAX_LINE_BYTES
        assert decode_request(line).args["spec"] == dumped
        view = JobSpec.parse(dumped)
        assert view.env == dumped["env"] and view.command == dumped["command"]
        for key in ("tensor_parallel_size", "seq_len", "batch_size"):
            assert type(dumped[key]) is int  # never a coerced bool, str or float
    assert accepted > 10 and refused > 10
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("value", ["8", True, False, 8.0, "0x8", [8], {"n": 8}, None])
def test_tensor_parallel_size_is_never_coerced(value: Any) -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({"host": "h", "backend": "command", "command": ["true"], "tensor_parallel_size": value})
    assert err.value.errors()[0]["loc"][0] == "tensor_parallel_size"


async def test_bodies_around_the_limit_whatever_the_framing(tmp_path: Path) -> None:
    ctl = Controller(settings_for(tmp_path / "home"), supervise=False)
    await ctl.start()
    try:
        app = create_app(ctl)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            limit = limits.MAX_BODY_BYTES
            rng = random.Random(7)
            sizes = [
                0,
                1,
                limit - 1,
                limit,
                limit + 1,
                *(rng.randint(limit // 2, 2 * limit) for _ in range(4)),
            ]
            for size in sizes:
                body = b" " * size
                chunk = rng.choice([1000, 65536, 300_000])

                async def stream(data: bytes = body, step: int = chunk) -> AsyncIterator[bytes]:
                    for i in range(0, len(data), step):
                        yield data[i : i + step]

                for content in (body, stream()):
                    r = await client.post(
                        "/api/runs", content=content, headers={"content-type": "application/json"}
                    )
                    assert (r.status_code == 413) == (size > limit), (size, r.status_code, r.text[:200])
    finally:
        await ctl.stop()


def test_form_env_never_loses_a_line_silently() -> None:
    rng = random.Random(99)
    for _ in range(300):
        names = [rng.choice(["A", "B", "C", "PATH", "X_1"]) for _ in range(rng.randint(1, 6))]
        text = "\n".join(rng.choice(["", "  "]) + f"{n}={rng.randint(0, 9)}" for n in names)
        spec, errors = forms.form_to_spec({"env": text})
        if len(set(names)) < len(names):
            assert "set twice" in errors["env"]
        else:
            assert "env" not in errors and len(spec["env"]) == len(names)


def test_form_numbers_are_ascii_digits_only() -> None:
    rng = random.Random(5)
    pieces = ["1", "0", "_", "+", "-", " ", "\u0663", "\uff18", "e", ".", "x", "9" * 40]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))
        spec, errors = forms.form_to_spec({"batch_size": text})
        if not text.strip():
            assert "batch_size" not in spec and "batch_size" not in errors  # left empty: the default
        elif "batch_size" in spec:
            assert text.strip().isascii() and "_" not in text and " " not in text.strip(), text
            assert spec["batch_size"] == int(text) and "batch_size" not in errors
        else:
            assert "whole number" in errors["batch_size"], text
    assert forms.form_to_spec({"batch_size": "+16"})[0]["batch_size"] == 16
