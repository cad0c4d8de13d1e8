"""Adversarial inputs for logins and secrets: forged cookies, token floods, session churn, secret env."""

from __future__ import annotations

import asyncio
import random
import string
from pathlib import Path

from web import forms, security

SEED = 1717


def test_mutated_cookies_never_load_as_another_session() -> None:
    rng = random.Random(SEED)
    signer = security.Signer(b"s" * 32, "gen")
    good = signer.new_session(authed=True)
    value = signer.dump(good)
    alphabet = string.ascii_letters + string.digits + "._-"
    for _ in range(2000):
        chars = list(value)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            i = rng.randrange(len(chars) + 1)
            if op < 0.4 and i < len(chars):
                chars[i] = rng.choice(alphabet)
            elif op < 0.7:
                chars.insert(i, rng.choice(alphabet))
            elif i < len(chars):
                del chars[i]
        mutated = "".join(chars)
        loaded = signer.load(mutated)
        assert loaded is None or (mutated == value and loaded == good), mutated
    for junk in ("", ".", "...", "a.b.c.d", "a.1.99999999999999999999.x", "x" * 5000, "a.1.-5.b"):
        assert signer.load(junk) is None


def test_attempt_limiter_never_exceeds_its_window() -> None:
    rng = random.Random(SEED)
    limiter = security.AttemptLimiter(limit=5, window_s=10.0)
    granted: dict[str, list[float]] = {}
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.5
        client = rng.choice("abcd")
        if limiter.acquire(client, now):
            granted.setdefault(client, []).append(now)
            if rng.random() < 0.1:
                limiter.refund(client)
                granted[client].pop()
        recent = [t for t in granted.get(client, []) if t > now - 10.0]
        assert len(recent) <= 5, (client, now, recent)


def test_session_table_matches_a_model_under_churn(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    signer = security.Signer(b"s" * 32, "gen")
    table = security.SessionTable(tmp_path / security.SESSIONS_FILE, "gen")
    live: list[security.Session] = []
    dead: list[security.Session] = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            s = live.pop(rng.randrange(len(live)))
            table.revoke(s)
            dead.append(s)
        else:
            s = signer.new_session(authed=True)
            table.add(s)
            live.append(s)
    reopened = security.SessionTable(tmp_path / security.SESSIONS_FILE, "gen")
    for t in (table, reopened):
        assert all(t.active(s) for s in live)
        assert not any(t.active(s) for s in dead)


async def test_a_flood_of_distinct_bad_tokens_costs_at_most_the_limit() -> None:
    checker = security.TokenChecker(security.hash_token("the-right-token"))
    verdicts = await asyncio.gather(*(checker.check(f"bad-{i}", "10.0.0.1") for i in range(200)))
    assert verdicts.count(security.Verdict.BAD) == security.ATTEMPTS_PER_MINUTE
    assert verdicts.count(security.Verdict.LIMITED) == 200 - security.ATTEMPTS_PER_MINUTE
    assert await checker.check("the-right-token", "10.0.0.2") is security.Verdict.OK
    assert await checker.check("the-right-token", "10.0.0.1") is security.Verdict.OK  # cached: no attempt


def test_secret_env_values_never_survive_stripping() -> None:
    rng = random.Random(SEED)
    names = ["HF_TOKEN", "hf_token", "WANDB_API_KEY", "DB_PASSWORD", "MY_SECRET", "AWS_SESSION_X",
             "LOG_LEVEL", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "SOME_AUTH", "COOKIE_JAR"]  # fmt: skip
    for _ in range(500):
        lines, secrets_, plain = [], [], []
        for _ in range(rng.randint(0, 6)):
            name = rng.choice(names)
            value = "".join(rng.choice(string.ascii_letters + "=/ ") for _ in range(rng.randint(8, 20)))
            value = "v" + value.strip() + "z"
            pad = rng.choice(["", " ", "  "])
            lines.append(f"{pad}{name}{pad}={value}")
            (secrets_ if security_name(name) else plain).append(value)
        out = forms.without_secret_values({"env": rng.choice(["\n", "\r\n"]).join(lines), "host": "h"})
        for v in secrets_:
            assert v not in out["env"]
        for v in plain:
            assert v in out["env"]
        assert out["host"] == "h"


def security_name(name: str) -> bool:
    """The masking rule, restated independently of web.filters for the oracle."""
    return any(w in name.upper() for w in ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL",
                                           "AUTH", "COOKIE", "SESSION"))  # fmt: skip
