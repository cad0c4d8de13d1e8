"""The benchmarks' controller in a process of its own, as ``eaglewatch serve`` runs it (not beside the
benchmark's Playwright driver, whose thread would share the controller's GIL).

    python tests/bench/serve_apart.py SETTINGS_JSON

Starts uvicorn with the Controller on ``Settings`` from the JSON (tests/web/conftest.py ``start_server``),
prints ``URL <url>`` once it listens, and stops when its stdin closes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class ApartServer:
    """The benchmark's end of a controller started in its own process."""

    def __init__(self, settings_json: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, settings_json], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("URL "):
            self.stop()
            raise RuntimeError(f"the controller process did not start (it said {line!r})")
        self.url = line.split()[1]

    def stop(self) -> None:
        """Close its stdin (it stops gracefully), kill it if it has not exited in 20 s."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    """Serve until stdin closes."""
    from controller.settings import Settings
    from tests.web.conftest import start_server

    settings = Settings.model_validate(json.loads(sys.argv[1]))
    srv = start_server(settings.home, settings=settings)
    print(f"URL {srv.url}", flush=True)
    try:
        sys.stdin.buffer.read()
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
