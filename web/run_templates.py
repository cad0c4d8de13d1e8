"""Saved run templates: named form values kept in ``<EAGLEWATCH_HOME>/run-templates.json`` (0600).

Values of secret-looking environment names (``HF_TOKEN=…``) are never stored: a template keeps the name
with an empty value, and one saved before this rule is emptied on read.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

from web.forms import without_secret_values

FILE_NAME = "run-templates.json"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}")


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
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {}  # a damaged file is ignored, never fatal; the next save rewrites it
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
        """Form values saved under ``name`` (secret values emptied)."""
        values = self._read().get(name)
        return None if values is None else without_secret_values(values)

    def save(self, name: str, values: dict[str, str]) -> None:
        """Save (or replace) a template, without the values of secret-looking env names."""
        if not _NAME_RE.fullmatch(name or ""):
            raise TemplateError("template name must be 1-64 letters, digits, spaces, '.', '_' or '-'")
        with self._lock:
            data = self._read()
            data[name] = without_secret_values({k: v for k, v in values.items() if k != "csrf_token"})
            # older files may hold secrets saved before the rule: rewrite them all without
            data = {k: without_secret_values(v) for k, v in data.items()}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # a stale temp file keeps its old mode through O_CREAT
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
