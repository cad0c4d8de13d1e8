"""Saved run templates: named form values kept in ``<EAGLEWATCH_HOME>/run-templates.json`` (0600).

Values of secret-looking environment names (``HF_TOKEN=…``) are never stored: a template keeps the name
with an empty value, and one saved before this rule is emptied on read.  A template's output_dir is a parent:
each load fills in a fresh ``<parent>/<run-name>-<UTC timestamp>``, so two runs from one template never
share a directory (the agent refuses one that already holds a capture).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path, PurePosixPath

from web.forms import without_secret_values
from web.security import write_private

FILE_NAME = "run-templates.json"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}")
#: The last part a load adds to a template's output_dir: ``<run-name>-YYYYMMDD-HHMMSS``.
_STAMPED_RE = re.compile(r".+-\d{8}-\d{6}")


def fresh_output_dir(values: dict[str, str], now: float) -> dict[str, str]:
    """``values`` with output_dir made ``<output_dir>/<name>-<UTC time of now>`` (unchanged without one)."""
    parent = values.get("output_dir", "").strip()
    if not parent:
        return values
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return {**values, "output_dir": f"{parent.rstrip('/')}/{values.get('name', '').strip() or 'run'}-{stamp}"}


def output_dir_parent(values: dict[str, str]) -> dict[str, str]:
    """``values`` with a loaded template's stamped output_dir back to its parent (what a template keeps)."""
    out = values.get("output_dir", "").strip()
    if out and _STAMPED_RE.fullmatch(PurePosixPath(out).name):
        return {**values, "output_dir": str(PurePosixPath(out).parent)}
    return values


class TemplateError(ValueError):
    """A template name that cannot be used."""


class TemplateStore:
    """A tiny JSON file of templates; written atomically, guarded by a lock (one process)."""

    def __init__(self, home: Path) -> None:
        self.path = home / FILE_NAME
        self._lock = threading.Lock()
        if self.path.exists() and self.path.stat().st_mode & 0o077:
            self.path.chmod(0o600)  # written world-readable by older versions

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}  # missing or damaged: ignored, never fatal; the next save rewrites it
        if not isinstance(data, dict):
            return {}
        return {
            str(k): {str(f): str(v) for f, v in val.items()}
            for k, val in data.items()
            if isinstance(val, dict)
        }

    def names(self) -> list[str]:
        """Template names, sorted."""
        return sorted(self._read())

    def get(self, name: str) -> dict[str, str] | None:
        """Form values saved under ``name`` (secret values emptied, a fresh output_dir under its parent)."""
        values = self._read().get(name)
        return None if values is None else fresh_output_dir(without_secret_values(values), time.time())

    def save(self, name: str, values: dict[str, str]) -> None:
        """Save (or replace) a template, without the values of secret-looking env names."""
        if not _NAME_RE.fullmatch(name or ""):
            raise TemplateError("template name must be 1-64 letters, digits, spaces, '.', '_' or '-'")
        with self._lock:
            data = self._read()
            kept = output_dir_parent({k: v for k, v in values.items() if k != "csrf_token"})
            data[name] = without_secret_values(kept)
            # older files may hold secrets saved before the rule: rewrite them all without
            data = {k: without_secret_values(v) for k, v in data.items()}
            write_private(self.path, json.dumps(data, indent=1, sort_keys=True).encode())
