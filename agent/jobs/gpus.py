"""GPU discovery for the agent: run nvidia-smi's CSV queries and parse them (stdlib only).

A malformed line is skipped and reported (in ``errors``), never raised, so one odd driver line cannot take
the daemon down.  A machine without nvidia-smi (``settings.NVIDIA_SMI`` overrides its path) answers exactly
``{"gpus": [], "processes": []}``; an ``errors`` list is added only when something went wrong.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from typing import Any

from agent import settings

GPU_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu")
PROCESS_FIELDS = ("pid", "gpu_uuid", "used_memory")
GPU_QUERY = ("--query-gpu=" + ",".join(GPU_FIELDS), "--format=csv,noheader,nounits")
PROCESS_QUERY = ("--query-compute-apps=" + ",".join(PROCESS_FIELDS), "--format=csv,noheader,nounits")
#: nvidia-smi can hang for many seconds on a wedged driver; the daemon must not.
DEFAULT_TIMEOUT_S = 10.0


class _BadField(ValueError):
    """A field that is neither a number nor one of nvidia-smi's placeholders."""


def _optional_int(raw: str, field: str) -> int | None:
    """An integer field; nvidia-smi's ``[N/A]``, ``[Not Supported]``, ``N/A`` etc. become None."""
    value = raw.strip()
    if not value or value.startswith("[") or value.upper() in ("N/A", "NOT SUPPORTED", "UNKNOWN ERROR"):
        return None
    try:
        # Some drivers print whole numbers as "27.0" or with units left on ("143771 MiB") in odd modes.
        return int(float(value.split()[0]))
    except ValueError:
        raise _BadField(f"{field} is not a number: {value[:40]!r}") from None


def _required_int(raw: str, field: str) -> int:
    """An integer field that must be present."""
    value = _optional_int(raw, field)
    if value is None:
        raise _BadField(f"{field} is missing ({raw.strip()[:40]!r})")
    return value


Rows = list[dict[str, Any]]


def _parse(
    text: str, query: str, fields: tuple[str, ...], row: Callable[[list[str]], dict[str, Any]]
) -> tuple[Rows, Rows]:
    """The rows ``row`` makes of each data line (at least ``len(fields)`` comma-separated fields, exactly
    that many for a process query), and the lines it could not read (the ``errors`` of ``query()``)."""
    rows: Rows = []
    errors: Rows = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        # A CSV header (--format=csv without noheader) and "No running processes found" carry no row.
        if not line or line.lower().startswith(("no running", "index,", "pid,")):
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < len(fields) or (query == "process" and len(parts) != len(fields)):
            reason = f"expected {len(fields)} comma-separated fields, got {len(parts)}"
        else:
            try:
                rows.append(row(parts))
                continue
            except _BadField as exc:
                reason = str(exc)
        errors.append({"query": query, "line": number, "text": line[:200], "reason": reason})
    return rows, errors


def _gpu_row(parts: list[str]) -> dict[str, Any]:
    # nvidia-smi does not quote; a comma inside the product name shows up as extra fields.
    tail = len(parts) - 4
    uuid = parts[1]
    if not uuid.startswith(("GPU-", "MIG-")):
        raise _BadField(f"uuid does not look like a GPU uuid: {uuid[:40]!r}")
    return {
        "index": _required_int(parts[0], "index"),
        "uuid": uuid,
        "name": ", ".join(parts[2:tail]),
        "memory_total_mib": _optional_int(parts[tail], "memory.total"),
        "memory_used_mib": _optional_int(parts[tail + 1], "memory.used"),
        "utilization_pct": _optional_int(parts[tail + 2], "utilization.gpu"),
        "temperature_c": _optional_int(parts[tail + 3], "temperature.gpu"),
    }


def _process_row(parts: list[str]) -> dict[str, Any]:
    return {
        "pid": _required_int(parts[0], "pid"),
        "gpu_uuid": parts[1],
        # "[N/A]" under MIG or in some containers: the process is there, its size unknown.
        "used_memory_mib": _optional_int(parts[2], "used_memory"),
    }


def parse_gpu_csv(text: str) -> tuple[Rows, Rows]:
    """Parse ``--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,temperature.gpu``."""
    return _parse(text, "gpu", GPU_FIELDS, _gpu_row)


def parse_process_csv(text: str) -> tuple[Rows, Rows]:
    """Parse ``--query-compute-apps=pid,gpu_uuid,used_memory`` (empty output: no processes)."""
    return _parse(text, "process", PROCESS_FIELDS, _process_row)


def find_nvidia_smi() -> str | None:
    """Path of the nvidia-smi to run, or None when there is none."""
    override = settings.NVIDIA_SMI.get()
    if override:
        return override if os.access(override, os.X_OK) else None
    return shutil.which("nvidia-smi")


def _run(argv: list[str], timeout_s: float) -> tuple[str | None, str | None]:
    """Run one nvidia-smi query: (stdout, None) on success, (None, reason) on failure."""
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a signal aimed at the daemon's group must not hit a hung query
        )
    except OSError as exc:
        return None, f"cannot run {argv[0]}: {exc.strerror or exc}"
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # The query runs in its own session: kill its whole group (a wrapper script's children too).
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        # Stuck in the driver (D state)? Leave it rather than block the daemon.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)
        return None, f"{argv[0]} {argv[1].split('=')[0]} timed out after {timeout_s:g} s"
    if proc.returncode != 0:
        message = (err or out).decode("utf-8", "replace").strip().splitlines()
        detail = message[0][:200] if message else "no output"
        return None, f"{argv[0]} exited with {proc.returncode}: {detail}"
    return out.decode("utf-8", "replace"), None


def query(timeout_s: float = DEFAULT_TIMEOUT_S, nvidia_smi: str | None = None) -> dict[str, Any]:
    """The ``gpus`` op's result: GPUs and compute processes from nvidia-smi; empty lists without one."""
    exe = nvidia_smi or find_nvidia_smi()
    result: dict[str, Any] = {"gpus": [], "processes": []}
    if exe is None:
        return result
    errors: list[dict[str, Any]] = []
    for query_name, argv, parse, key in (
        ("gpu", GPU_QUERY, parse_gpu_csv, "gpus"),
        ("process", PROCESS_QUERY, parse_process_csv, "processes"),
    ):
        if key == "processes" and not result["gpus"]:
            break  # no GPU: no process query
        text, failure = _run([exe, *argv], timeout_s)
        if failure is not None:
            errors.append({"query": query_name, "line": None, "text": "", "reason": failure})
            continue
        result[key], bad = parse(text or "")
        errors.extend(bad)
    if errors:
        result["errors"] = errors
    return result
