"""Saved run templates: named form values kept in ``<EAGLEWATCH_HOME>/run-templates.json``."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

FILE_NAME = "run-templates.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}$")


class TemplateError(ValueError):
    """A template name that cannot be used."""


class TemplateStore:
    """A tiny JSON file of templates; written atomically, guarded by a lock (one process)."""

    def __init__(self, home: Path) -> None:
        self.path = home / FILE_NAME
        self._lock = threading.Lock()

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
        """Form values saved under ``name``."""
        return self._read().get(name)

    def save(self, name: str, values: dict[str, str]) -> None:
        """Save (or replace) a template; secrets are not expected in form values."""
        if not _NAME_RE.match(name or ""):
            raise TemplateError("template name must be 1-64 letters, digits, spaces, '.', '_' or '-'")
        with self._lock:
            data = self._read()
            data[name] = {k: v for k, v in values.items() if k != "csrf_token"}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)
