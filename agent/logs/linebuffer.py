"""LineBuffer: the watcher's split log lines, recent ones kept in memory, served to every follower.

How it works
------------
The run's watcher is the only reader and splitter of its log: each line it splits is appended here with
its stream offset, and ``end`` is the watcher's resume point (the splitter's ``pending_offset``, or the next
generation's base after a seam).  A follower at stream offset ``pos`` asks ``read(pos, …)``: when ``pos`` is
the offset of a held line, or ``end`` itself, it gets the lines from there (bounded) and the offset to ask
for next; otherwise (``None``) ``pos`` is older than what is held, or not a line start the watcher saw,
and the follower reads the log itself until it reaches an offset the buffer serves.  Lines are the
watcher's own, so a follower sees exactly the lines the watcher split, once each, in order.
Memory is bounded: the oldest lines go first once ``max_lines`` or ``max_bytes`` is passed.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from itertools import accumulate, islice
from operator import attrgetter

from agent.logs.splitter import Line

#: Per-line overhead counted towards a batch's byte budget (offset and JSON framing).
LINE_OVERHEAD = 16
_offset = attrgetter("offset")
_text = attrgetter("text")


class LineBuffer:
    """Recent split lines of one run's log: ``append`` from the watcher, ``read`` from followers."""

    def __init__(self, max_lines: int = 100_000, max_bytes: int = 8 << 20) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._offsets: list[int] = []
        self._texts: list[str] = []
        self._cum: list[int] = []  # _cum[i]: bytes of lines [0, i] (absolute since the last compaction)
        self._head = 0  # index of the oldest live line
        self._base = 0  # _cum of the line before _head (0 when none)
        self.end = -1  # the offset after the last line; -1: nothing held yet (serve nothing)

    def reset(self, offset: int) -> None:
        """Forget every line; the watcher resumes splitting at ``offset``."""
        self._offsets, self._texts, self._cum = [], [], []
        self._head = self._base = 0
        self.end = offset

    def append(self, lines: Iterable[Line], end: int) -> None:
        """Add lines the watcher split (offsets increasing) and its new resume offset ``end``."""
        lines = lines if isinstance(lines, list) else list(lines)
        if lines:  # map/accumulate: no Python code runs per line (this is on every line's path)
            total = self._cum[-1] if self._cum else 0
            self._offsets.extend(map(_offset, lines))
            self._texts.extend(map(_text, lines))
            sizes = map(LINE_OVERHEAD.__add__, map(len, map(_text, lines)))
            self._cum.extend(islice(accumulate(sizes, initial=total), 1, None))
        self.end = end
        self._trim()

    def _trim(self) -> None:
        n = len(self._offsets)
        head = max(self._head, n - self.max_lines)
        if self._cum and self._cum[-1] - self._base > self.max_bytes:
            head = max(head, bisect_left(self._cum, self._cum[-1] - self.max_bytes) + 1)
        if head != self._head:
            self._head = head
            self._base = self._cum[head - 1] if head > 0 else 0
        if self._head > 4096 and self._head * 2 > n:  # compact: drop the dead prefix in one go
            del self._offsets[: self._head], self._texts[: self._head], self._cum[: self._head]
            self._head = 0

    def __len__(self) -> int:
        return len(self._offsets) - self._head

    def read(self, pos: int, max_lines: int, max_bytes: int) -> tuple[list[tuple[int, str]], int] | None:
        """Lines from stream offset ``pos`` (at most ``max_lines``, about ``max_bytes``) and the offset after
        them; ``None`` when ``pos`` is not served from memory (too old, or not a line start seen here)."""
        if self.end < 0:
            return None
        if pos == self.end:
            return [], pos
        i = bisect_left(self._offsets, pos, self._head)
        if i >= len(self._offsets) or self._offsets[i] != pos:
            return None
        before = self._cum[i - 1] if i > 0 else 0
        j = min(i + max_lines, len(self._offsets), bisect_right(self._cum, before + max_bytes, i))
        j = max(j, i + 1)  # one over-long line still goes out alone
        nxt = self._offsets[j] if j < len(self._offsets) else self.end
        return list(zip(self._offsets[i:j], self._texts[i:j], strict=True)), nxt
