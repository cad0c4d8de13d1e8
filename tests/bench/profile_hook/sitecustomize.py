"""Bench-only: with EAGLEWATCH_PROFILE_OUT set, a Python started with this folder on its path runs under
cProfile (bench_daemon_ingest.py --profile puts it there for the daemon); the stats are written at exit."""

from __future__ import annotations

import atexit
import cProfile
import os

_OUT = os.environ.get("EAGLEWATCH_PROFILE_OUT")
if _OUT:
    _profile = cProfile.Profile()

    def _dump(out: str = _OUT) -> None:
        _profile.disable()
        _profile.dump_stats(out)

    atexit.register(_dump)
    _profile.enable()
