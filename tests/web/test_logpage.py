"""Log paging logic over the facade's read_log contract (a list stands in; real stores: browser tests)."""

from __future__ import annotations

from typing import Any

from web.logpage import read_log_page


class Lines:
    """The facade's read_log contract over a list (ascending offsets, lines after an offset, limit)."""

    def __init__(self, n: int) -> None:
        self.rows = [
            {"offset": i * 37, "text": f"line {i}" + (" ERROR boom" if i % 100 == 0 else "")}
            for i in range(n)
        ]
        self.calls = 0

    async def read_log(
        self, run_id: str, *, after_offset: int = -1, limit: int = 1000, query: str | None = None,
        errors_only: bool = False,
    ) -> list[dict[str, Any]]:  # fmt: skip
        self.calls += 1
        out = [r for r in self.rows if r["offset"] > after_offset]
        if query:
            out = [r for r in out if query.lower() in r["text"].lower()]
        if errors_only:
            out = [r for r in out if "ERROR" in r["text"]]
        return out[:limit]


async def test_tail_of_a_long_log_with_few_reads() -> None:
    log = Lines(100_000)
    page = await read_log_page(log, "r", after=-1, before=None, limit=200, q=None, errors_only=False)
    assert [r["text"] for r in page] == [r["text"] for r in log.rows[-200:]]
    assert log.calls < 60  # binary search, not a full scan in pages


async def test_page_before_an_offset_and_short_logs() -> None:
    log = Lines(1000)
    before = log.rows[500]["offset"]
    page = await read_log_page(log, "r", after=-1, before=before, limit=200, q=None, errors_only=False)
    assert page == log.rows[300:500]
    small = Lines(50)
    assert (
        await read_log_page(small, "r", after=-1, before=None, limit=200, q=None, errors_only=False)
        == small.rows
    )
    after = await read_log_page(
        log, "r", after=log.rows[10]["offset"], before=None, limit=5, q=None, errors_only=False
    )
    assert after == log.rows[11:16]


async def test_filtered_views_keep_the_last_matches() -> None:
    log = Lines(1000)
    page = await read_log_page(log, "r", after=-1, before=None, limit=3, q=None, errors_only=True)
    assert [r["text"] for r in page] == ["line 700 ERROR boom", "line 800 ERROR boom", "line 900 ERROR boom"]
    page = await read_log_page(log, "r", after=-1, before=None, limit=2, q="line 99", errors_only=False)
    assert [r["text"] for r in page] == ["line 998", "line 999"]
