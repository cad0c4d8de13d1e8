"""Ops about a run's data: the job's `--forecast` and `--capture` of a spec (in a child process: torch and
pydantic stay out of the daemon) and the manifest a job keeps in its output directory."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from agent.runs.outdir import Capture

#: A forecast reads the dataset (tokenising a sample of rows at most): minutes only for a slow disk.
TIMEOUT_S = 300
#: The capture a spec asks for reads only the model's config.json.
CAPTURE_TIMEOUT_S = 60


class ForecastError(Exception):
    """The forecast could not be made; the message is the job's own (a bad spec, an unreadable dataset)."""


async def _ask_job(spec: dict[str, Any], state_dir: Path, flag: str, timeout_s: float) -> dict[str, Any]:
    """The JSON object the job prints for ``extract --spec SPEC flag``; ForecastError with its message."""
    pkg_root = str(Path(__file__).resolve().parents[2])
    raw_env = spec.get("env")
    env_spec: dict[str, Any] = raw_env if isinstance(raw_env, dict) else {}
    inherited = os.environ.get("PYTHONPATH", "")
    env = {
        **os.environ,
        **{k: v for k, v in env_spec.items() if isinstance(k, str) and isinstance(v, str)},
        "PYTHONPATH": pkg_root + (os.pathsep + inherited if inherited else ""),
    }
    # the spec file lives in the daemon's private state dir (it may hold secret env values)
    fd, name = tempfile.mkstemp(prefix=f"{flag.lstrip('-')}-", suffix=".json", dir=state_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(spec, fh)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent", "extract", "--spec", name, flag,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env,
        )  # fmt: skip
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise ForecastError(f"the job's {flag} took longer than {timeout_s} s") from None
    finally:
        os.unlink(name)
    if proc.returncode == 0:
        try:
            result = json.loads(out)
        except ValueError:
            result = None
        if isinstance(result, dict):
            return result
    lines = [ln for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
    message = lines[-1] if lines else f"exit status {proc.returncode}"
    raise ForecastError(message.removeprefix("eaglewatch extract: error: ")[:1000])


async def forecast(spec: dict[str, Any], state_dir: Path) -> dict[str, Any]:
    """The job's forecast of a spec: {"bytes", "free_bytes", "fits", "estimated", ...}, or ForecastError."""
    return await _ask_job(spec, state_dir, "--forecast", TIMEOUT_S)


async def spec_capture(spec: dict[str, Any], state_dir: Path) -> Capture | None:
    """The capture a spec asks for, resolved by the job's own code (default layer ids, the engine's dtype);
    None when the job cannot tell (an unreadable model: the job then refuses the spec itself)."""
    try:
        return Capture.from_doc(await _ask_job(spec, state_dir, "--capture", CAPTURE_TIMEOUT_S))
    except ForecastError:
        return None


MANIFEST_MAX_BYTES = 16 << 20


class ManifestError(Exception):
    """No readable manifest.json where the run writes."""


def read_manifest(out_dir: Path) -> dict[str, Any]:
    """out_dir/manifest.json without its per-sample token map ("samples" becomes a count: small replies)."""
    path = out_dir / "manifest.json"
    try:
        if path.stat().st_size > MANIFEST_MAX_BYTES:
            raise ManifestError(f"{path} is larger than {MANIFEST_MAX_BYTES} bytes")
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"no manifest.json in {out_dir} (the job has not started writing)") from None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path} cannot be read: {exc}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{path} is not a JSON object")
    samples = doc.pop("samples", None)
    doc["samples_listed"] = len(samples) if isinstance(samples, dict) else 0
    return doc
