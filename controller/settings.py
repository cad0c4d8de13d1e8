"""Controller settings: $EAGLEWATCH_HOME/config.toml plus EAGLEWATCH_* environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)


def default_home() -> Path:
    """$EAGLEWATCH_HOME or ~/.local/share/eaglewatch."""
    env = os.environ.get("EAGLEWATCH_HOME")
    return Path(env).expanduser() if env else Path.home() / ".local" / "share" / "eaglewatch"


def ensure_home(path: Path) -> Path:
    """Create the home directory private to its owner (0700); an existing one we own is tightened to 0700.

    It holds the database (launched specs with their environment), the web token hash, the cookie
    secret and the run templates: nobody else on the workstation has any business listing it.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        path.chmod(0o700)
    return path


class Settings(BaseSettings):
    """Everything the controller needs to know; precedence: init args > env > config.toml > defaults.

    Each field is `EAGLEWATCH_<NAME>` in the environment and `<name>` in config.toml (except `home`, which
    says where config.toml is).
    """

    model_config = SettingsConfigDict(env_prefix="EAGLEWATCH_", extra="ignore")

    home: Path = Field(
        default_factory=default_home, description="the controller's state: database, config.toml, web login"
    )
    bind: str = Field(default="127.0.0.1", description="address `serve` listens on")
    port: int = Field(default=8765, ge=0, le=65535, description="port `serve` listens on")
    db_path: Path | None = Field(
        default=None, description="the SQLite database (unset: `<home>/eaglewatch.db`)"
    )
    apprise_urls: list[SecretStr] = Field(
        default_factory=list,
        description="alert channels (slack://, ntfy://, mailto://, json://…), secret; env: a JSON list",
    )
    unreachable_minutes: float = Field(
        default=5.0, ge=0, description="alert when a host stays unreachable this long"
    )
    stall_factor: float = Field(
        default=5.0, gt=0, description="alert when progress is overdue by this factor × the recent interval"
    )
    stall_min_s: float = Field(default=60.0, ge=0, description="never call a run stalled sooner than this")
    cooldown_s: float = Field(
        default=600.0, ge=0, description="the same alert for the same run or host at most once per this"
    )
    known_hosts: Path | None = Field(
        default=None, description="SSH known_hosts (unset: `~/.ssh/known_hosts`)"
    )
    ssh_config: Path | None = Field(
        default=None, description="SSH config with host aliases (unset: `~/.ssh/config`)"
    )
    keepalive_interval: float = Field(default=15.0, gt=0, description="seconds between SSH keepalives")
    keepalive_count_max: int = Field(
        default=3, ge=1, description="unanswered keepalives before a link counts as down"
    )
    connect_timeout: float = Field(default=15.0, gt=0, description="seconds an SSH connect may take")
    reconnect_initial_s: float = Field(default=0.5, gt=0, description="first wait before reconnecting a link")
    reconnect_max_s: float = Field(
        default=30.0, gt=0, description="longest wait between reconnects (the wait doubles up to it)"
    )
    log_retention_days: float | None = Field(
        default=None,
        gt=0,
        description="hourly, drop the log lines of runs ended this many days ago (unset: keep)",
    )
    sweep_interval_s: float = Field(default=5.0, gt=0, description="how often stall/unreachable rules run")
    remote_base: str = Field(
        default=".local/share/eaglewatch",
        description="where the agent is uploaded on hosts (relative to the remote home, or absolute)",
    )
    outbox_max_backoff_s: float = Field(
        default=300.0, gt=0, description="longest wait between retries of an undelivered alert"
    )
    session_ttl_s: float = Field(
        default=12 * 3600.0, gt=0, le=30 * 86400, description="web login sessions expire after this"
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="extra DNS names the web UI answers to (DNS-rebinding guard); env: comma-separated",
    )
    demo_home: Path = Field(
        default_factory=lambda: Path.home() / ".local" / "share" / "eaglewatch-demo",
        description="the demo's state, never the controller's home (`demo --home` wins)",
    )

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        """The environment gives one comma-separated string; config.toml a list."""
        return value.split(",") if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Read config.toml from the home directory between env vars and defaults."""
        home = init_settings.init_kwargs.get("home") if hasattr(init_settings, "init_kwargs") else None
        toml_path = Path(home or default_home()) / "config.toml"
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=toml_path))

    @property
    def database(self) -> Path:
        """Path of the SQLite database file."""
        return self.db_path or self.home / "eaglewatch.db"

    def ssh_options(self) -> dict[str, Any]:
        """Keyword arguments for asyncssh.connect shared by every link."""
        opts: dict[str, Any] = {
            "agent_forwarding": False,
            "keepalive_interval": self.keepalive_interval,
            "keepalive_count_max": self.keepalive_count_max,
            "connect_timeout": self.connect_timeout,
            # AES-GCM first: hardware-accelerated and cheaper per packet than chacha20 in asyncssh.
            "encryption_algs": [
                "aes128-gcm@openssh.com",
                "aes256-gcm@openssh.com",
                "chacha20-poly1305@openssh.com",
                "aes128-ctr",
                "aes256-ctr",
            ],
        }
        if self.known_hosts is not None:
            opts["known_hosts"] = str(self.known_hosts)
        if self.ssh_config is not None:
            opts["config"] = [str(self.ssh_config)]
        return opts
