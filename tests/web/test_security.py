"""Pure security pieces: token hashing, cookie signing, CSRF, Host/Origin rules, loopback detection."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from web import security


def test_token_is_stored_hashed_and_created_once(tmp_path: Path) -> None:
    token = security.ensure_token(tmp_path)
    assert token and len(token) >= 24
    text = (tmp_path / security.TOKEN_FILE).read_text()
    assert token not in text
    assert stat.S_IMODE((tmp_path / security.TOKEN_FILE).stat().st_mode) == 0o600
    assert security.ensure_token(tmp_path) is None  # printed once: never regenerated or shown again
    stored = security.load_token_hash(tmp_path)
    assert stored is not None
    assert security.verify_token(token, stored)
    assert not security.verify_token(token + "x", stored)
    assert not security.verify_token("", stored)


def test_secret_is_private_and_stable(tmp_path: Path) -> None:
    a = security.load_secret(tmp_path)
    assert stat.S_IMODE((tmp_path / security.SECRET_FILE).stat().st_mode) == 0o600
    assert security.load_secret(tmp_path) == a


def test_session_cookie_roundtrip_and_forgery() -> None:
    signer = security.Signer(b"k" * 32)
    s = signer.new_session(authed=True)
    value = signer.dump(s)
    assert signer.load(value) == s
    sid, _flag, exp, mac = value.split(".")
    assert signer.load(f"{sid}.0.{exp}.{mac}") is None  # flipping the auth flag breaks the signature
    assert signer.load(f"{sid}.1.{int(exp) + 3600}.{mac}") is None  # so does extending the expiry
    other = "1" if mac.endswith("0") else "0"
    assert signer.load(f"{sid}.1.{exp}.{mac[:-1]}{other}") is None  # one changed character of the MAC
    assert signer.load("garbage") is None
    assert security.Signer(b"j" * 32).load(value) is None


def test_session_cookie_expires_and_dies_with_the_token() -> None:
    signer = security.Signer(b"k" * 32, "gen-a", ttl_s=60)
    s = signer.new_session(authed=True, now=1000.0)
    value = signer.dump(s)
    assert signer.load(value, now=1059.0) == s
    assert signer.load(value, now=1060.0) is None  # expired
    assert security.Signer(b"k" * 32, "gen-b").load(value, now=1000.0) is None  # another token's cookie
    assert "Max-Age=" in security.session_cookie(signer, signer.new_session(False))


def test_session_table_revokes_and_forgets_other_generations(tmp_path: Path) -> None:
    path = tmp_path / security.SESSIONS_FILE
    signer = security.Signer(b"k" * 32, "gen-a")
    table = security.SessionTable(path, "gen-a")
    a, b = signer.new_session(True), signer.new_session(True)
    table.add(a)
    table.add(b)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert a.sid not in path.read_text()  # only digests: the file cannot be replayed as cookies
    table.revoke(a)
    assert not table.active(a) and table.active(b)
    assert security.SessionTable(path, "gen-a").active(b)  # survives a restart
    assert not security.SessionTable(path, "gen-b").active(b)  # but not a new token
    assert not table.active(b, now=b.expires)


def test_csrf_token_bound_to_session() -> None:
    signer = security.Signer(b"k" * 32)
    a, b = signer.new_session(False), signer.new_session(False)
    assert signer.check_csrf(a, signer.csrf_token(a))
    assert not signer.check_csrf(b, signer.csrf_token(a))
    assert not signer.check_csrf(a, None)
    assert not signer.check_csrf(None, signer.csrf_token(a))


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1:8765", True), ("localhost:8765", True), ("[::1]:8765", True), ("10.1.2.3", True),
        ("gpu-box.lan:8765", True), ("evil.example:8765", False), ("127.0.0.1.evil.example", False),
        ("", False), (None, False), ("localhost.evil.example", False),
    ],
)  # fmt: skip
def test_host_header_rules(host: str | None, ok: bool) -> None:
    assert security.host_allowed(host, frozenset({"gpu-box.lan"})) is ok


@pytest.mark.parametrize(
    ("origin", "host", "ok"),
    [
        (None, "127.0.0.1:8765", True), ("http://127.0.0.1:8765", "127.0.0.1:8765", True),
        ("http://127.0.0.1:9999", "127.0.0.1:8765", False), ("https://evil.example", "127.0.0.1:8765", False),
        ("null", "127.0.0.1:8765", False), ("file://", "127.0.0.1:8765", False),
    ],
)  # fmt: skip
def test_origin_rules(origin: str | None, host: str, ok: bool) -> None:
    assert security.origin_matches(origin, host) is ok


@pytest.mark.parametrize(
    ("bind", "loop"),
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("0.0.0.0", False), ("192.168.1.5", False)],
)
def test_loopback(bind: str, loop: bool) -> None:
    assert security.is_loopback(bind) is loop
