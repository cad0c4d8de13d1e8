"""Pages of a run's stored log for the viewer: the tail, or the lines before an offset.

The facade's ``read_log`` reads forwards (lines after an offset, ascending). The tail of a 100k-line log is
found without reading it all: the number of lines after offset A is non-increasing in A, so a binary
search over A (each probe reads at most ``limit`` rows) finds where the last ``limit`` lines start.
Filtered views (search, errors only) read forwards once and keep the last matches.
"""

from __future__ import annotations

from typing import Any, Protocol

MAX_OFFSET = 2**62
_SCAN_LIMIT = 100_000


class LogReader(Protocol):
    """The facade's ``read_log`` (controller/service.py's Controller has it)."""

    async def read_log(
        self,
        run_id: str,
        *,
        after_offset: int = -1,
        limit: int = 1000,
        query: str | None = None,
        errors_only: bool = False,
    ) -> list[dict[str, Any]]:
        """Lines after ``after_offset``, ascending, filtered, at most ``limit``."""
        ...


async def _count_after(
    ctl: LogReader, run_id: str, after: int, before: int | None, limit: int
) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = await ctl.read_log(run_id, after_offset=after, limit=limit)
    return [ln for ln in lines if before is None or ln["offset"] < before]


async def read_log_page(
    ctl: LogReader,
    run_id: str,
    *,
    after: int,
    before: int | None,
    limit: int,
    q: str | None,
    errors_only: bool,
) -> list[dict[str, Any]]:
    """Lines after ``after`` (ascending); with ``after == -1`` and no filter: the last ``limit`` lines
    (before ``before`` when given)."""
    if q or errors_only:
        if after >= 0 and before is None:
            page: list[dict[str, Any]] = await ctl.read_log(
                run_id, after_offset=after, limit=limit, query=q or None, errors_only=errors_only
            )
            return page
        found: list[dict[str, Any]] = await ctl.read_log(
            run_id, after_offset=after, limit=_SCAN_LIMIT, query=q or None, errors_only=errors_only
        )
        return [ln for ln in found if before is None or ln["offset"] < before][-limit:]
    if after >= 0:
        return await _count_after(ctl, run_id, after, before, limit)
    first = await _count_after(ctl, run_id, -1, before, limit + 1)
    if len(first) <= limit:
        return first
    # Largest A with at least ``limit`` lines in (A, before): those are the last ``limit`` lines.
    lo = -1
    hi = before if before is not None else 1024
    if before is None:
        while len(await _count_after(ctl, run_id, hi, None, limit)) >= limit:
            lo, hi = hi, min(hi * 4, MAX_OFFSET)
            if hi == MAX_OFFSET:
                break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(await _count_after(ctl, run_id, mid, before, limit)) >= limit:
            lo = mid
        else:
            hi = mid
    return (await _count_after(ctl, run_id, lo, before, limit))[:limit]
