"""Settings: defaults, config.toml in EAGLEWATCH_HOME, environment overrides, secrets never rendered."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from controller.service import Controller
from controller.settings import Settings
from web.app import create_app


def test_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLEWATCH_HOME", str(tmp_path))
    s = Settings()
    assert (s.home, s.bind, s.port, s.database) == (tmp_path, "127.0.0.1", 8765, tmp_path / "eaglewatch.db")
    opts = s.ssh_options()
    assert (
        opts["agent_forwarding"] is False and opts["keepalive_interval"] > 0 and opts["connect_timeout"] > 0
    )
    assert "known_hosts" not in opts  # asyncssh's default: ~/.ssh/known_hosts, verified — never None


def test_config_toml_then_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.toml").write_text(
        'port = 9000\nstall_factor = 7.5\napprise_urls = ["json://127.0.0.1:1/secret-token"]\n'
        f'known_hosts = "{tmp_path / "kh"}"\n'
    )
    monkeypatch.setenv("EAGLEWATCH_HOME", str(tmp_path))
    monkeypatch.setenv("EAGLEWATCH_PORT", "9100")
    s = Settings()
    assert s.port == 9100 and s.stall_factor == 7.5
    assert s.ssh_options()["known_hosts"] == str(tmp_path / "kh")
    assert s.apprise_urls[0].get_secret_value().endswith("secret-token")
    assert "secret-token" not in repr(s) and "secret-token" not in s.model_dump_json()


def test_bad_value_names_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLEWATCH_HOME", str(tmp_path))
    monkeypatch.setenv("EAGLEWATCH_PORT", "99999")
    with pytest.raises(ValueError, match="port"):
        Settings()


def test_allowed_hosts_from_env_and_config_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLEWATCH_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text('allowed_hosts = ["ew.example", "b.example"]\n')
    assert Settings().allowed_hosts == ["ew.example", "b.example"]
    monkeypatch.setenv("EAGLEWATCH_ALLOWED_HOSTS", "c.example, d.example")
    assert [h.strip() for h in Settings().allowed_hosts] == ["c.example", "d.example"]


async def test_the_web_ui_answers_to_names_from_config_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('allowed_hosts = ["EW.example"]\n')
    monkeypatch.setenv("EAGLEWATCH_HOME", str(home))
    ctl = Controller(Settings(), supervise=False)
    await ctl.start()
    try:
        transport = httpx.ASGITransport(app=create_app(ctl))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            assert (await c.get("/api/health", headers={"host": "ew.example:8765"})).status_code == 200
            r = await c.get("/api/health", headers={"host": "other.example:8765"})
            assert r.status_code == 400 and r.json()["error"] == "bad_host"
    finally:
        await ctl.stop()


def test_the_demo_home_is_a_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLEWATCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Settings().demo_home == tmp_path / ".local" / "share" / "eaglewatch-demo"
    monkeypatch.setenv("EAGLEWATCH_DEMO_HOME", str(tmp_path / "demo"))
    assert Settings().demo_home == tmp_path / "demo"
