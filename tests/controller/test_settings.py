"""Settings: defaults, config.toml in EAGLEWATCH_HOME, environment overrides, secrets never rendered."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.settings import Settings


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
