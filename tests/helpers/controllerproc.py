"""The controller in a process of its own (as `eaglewatch serve` runs it, without the web app), for tests
and benches that SIGKILL it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from controller.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = """\
import asyncio
from controller.service import Controller
async def main():
    async with Controller():
        await asyncio.Event().wait()
asyncio.run(main())
"""


def spawn_controller(settings: Settings, **env: str) -> subprocess.Popen[bytes]:
    """Start a Controller on ``settings``' home, hosts and remote base (and ``env``'s EAGLEWATCH_* extras) in
    a new session; its stderr goes to ``<home>/ctl.log``."""
    full = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        EAGLEWATCH_HOME=str(settings.home),
        EAGLEWATCH_KNOWN_HOSTS=str(settings.known_hosts),
        EAGLEWATCH_SSH_CONFIG=str(settings.ssh_config),
        EAGLEWATCH_REMOTE_BASE=settings.remote_base,
        **env,
    )
    with open(settings.home / "ctl.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", CONTROLLER],
            env=full,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
