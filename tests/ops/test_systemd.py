"""systemd units: `systemd-analyze verify` accepts both as shipped, and their key settings hold.

systemd-analyze comes from Debian's `systemd` package (installed by .ci/setup when missing); it verifies
unit files offline, with no running systemd.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENT_UNIT = ROOT / "systemd" / "eaglewatch-agent.service"
CONTROLLER_UNIT = ROOT / "systemd" / "eaglewatch.service"
ANALYZE = shutil.which("systemd-analyze")
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze missing: apt-get install systemd")


def unit_settings(path: Path) -> dict[str, list[str]]:
    """Every `Section.Key` of a unit file with all its values in order (keys may repeat)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}.{key}", []).append(value)
    return settings


def analyze(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run systemd-analyze (argv list) and return its result."""
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def user_env(home: Path) -> dict[str, str]:
    """An environment for `systemd-analyze --user` with HOME where the agent's console script is found."""
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "bin" / "eaglewatch-agent").symlink_to(BIN / "eaglewatch-agent")
    (home / "run").mkdir()
    return {**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run")}


def controller_copy(tmp_path: Path) -> Path:
    """The controller unit with ExecStart pointing at this venv instead of /opt/eaglewatch/bin."""
    text = CONTROLLER_UNIT.read_text().replace("/opt/eaglewatch/bin/", f"{BIN}/")
    copy = tmp_path / "eaglewatch.service"
    copy.write_text(text)
    return copy


def test_agent_unit_verifies(tmp_path: Path) -> None:
    result = analyze("--user", "verify", str(AGENT_UNIT), env=user_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", f"systemd-analyze warned: {result.stderr}"


def test_controller_unit_verifies(tmp_path: Path) -> None:
    result = analyze("verify", str(controller_copy(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", f"systemd-analyze warned: {result.stderr}"


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a unit whose program is missing or with a bad setting is reported."""
    broken = tmp_path / "eaglewatch-agent.service"
    broken.write_text(AGENT_UNIT.read_text().replace("KillMode=process", "KillMode=procezz"))
    result = analyze(
        "--user",
        "verify",
        str(broken),
        env={**os.environ, "HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path)},
    )
    assert result.returncode != 0
    assert "procezz" in result.stderr and "not executable" in result.stderr


def test_agent_unit_keeps_jobs_alive_and_restarts() -> None:
    s = unit_settings(AGENT_UNIT)
    assert s["Service.ExecStart"][0].split()[1:3] == ["daemon", "--state-dir"]
    assert s["Service.ExecStart"][0].split()[0].endswith("/eaglewatch-agent")
    assert s["Service.KillMode"] == ["process"]  # jobs survive a daemon restart or stop
    assert s["Service.Restart"] == ["on-failure"]
    assert s["Service.NoNewPrivileges"] == ["yes"]
    assert s["Install.WantedBy"] == ["default.target"]  # a user unit
    # Nothing that would stop the daemon signalling its jobs or reading their /proc, or hide the GPUs.
    for key in (
        "PrivateUsers",
        "ProtectProc",
        "PrivateDevices",
        "DevicePolicy",
        "PrivatePIDs",
        "CapabilityBoundingSet",
        "MemoryDenyWriteExecute",
        "ProtectSystem",
        "PrivateTmp",
    ):
        assert f"Service.{key}" not in s, key
    assert "loginctl enable-linger" in AGENT_UNIT.read_text()


def test_controller_unit_is_sandboxed(tmp_path: Path) -> None:
    s = unit_settings(CONTROLLER_UNIT)
    assert s["Service.ExecStart"][0].split()[1] == "serve"
    assert s["Service.Restart"] == ["on-failure"]
    for key, value in [
        ("ProtectSystem", "strict"),
        ("PrivateTmp", "yes"),
        ("NoNewPrivileges", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("RestrictSUIDSGID", "yes"),
        ("LockPersonality", "yes"),
        ("StateDirectory", "eaglewatch"),
    ]:
        assert s[f"Service.{key}"] == [value], key
    # systemd's own scoring of the sandbox: exposure at most 2.0 of 10 ("OK").
    result = analyze("security", "--offline=true", "--threshold=20", str(controller_copy(tmp_path)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "Overall exposure level for eaglewatch.service" in result.stdout


def test_agent_unit_uses_the_state_dir_that_connect_finds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The controller runs `eaglewatch-agent connect` with the default state dir: it must find this daemon."""
    from agent import settings

    monkeypatch.delenv(settings.AGENT_HOME.name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    argv = unit_settings(AGENT_UNIT)["Service.ExecStart"][0].split()
    state = argv[argv.index("--state-dir") + 1].replace("%h", str(tmp_path))
    assert Path(state) == settings.AGENT_HOME.get()
