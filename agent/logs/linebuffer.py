"""LineBuffer: the watcher's split log lines, recent ones kept in memory, served to every follower.

The run's watcher is the only reader and splitter of its log: what it splits is appended here, with its resume
point ``end``.  Lines are held in segments: a raw ``Block`` (split only when a follower asks for separate
lines) or the splitter's ``Line`` objects.  A follower at stream offset ``pos`` asks ``read`` or
``read_text``: from a held line start (or ``end``) it is served from memory; otherwise (``None``) it reads the
log itself until it reaches an offset served here, so it sees exactly the watcher's lines, once each, in
order.  Memory is bounded: the oldest lines go first once ``max_lines`` or ``max_bytes`` is passed.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from itertools import accumulate, islice
from operator import attrgetter

from agent.logs.splitter import Block, Line

#: Per-line overhead counted towards a batch's byte budget (offset and JSON framing).
LINE_OVERHEAD = 16
_offset = attrgetter("offset")
_text = attrgetter("text")
_start = attrgetter("start")


class _Segment:
    """Consecutive held lines: a raw block until split, then per-line offsets, texts and running sizes."""

    __slots__ = ("base", "count", "cum", "head", "offsets", "raw", "start", "texts")

    def __init__(self, start: int) -> None:
        self.raw: bytes | None = None  # a Block's bytes, until split
        self.start = start  # offset of the first live line
        self.count = 0  # live lines
        self.offsets: list[int] = []
        self.texts: list[str] = []
        self.cum: list[int] = []  # cum[i]: budget bytes of lines [0, i]
        self.head = 0  # index of the first live line
        self.base = 0  # cum of the line before head (0 when none)

    @property
    def size(self) -> int:
        """Budget bytes of the live lines."""
        if self.raw is not None:
            return len(self.raw) - self.count + LINE_OVERHEAD * self.count
        return (self.cum[-1] if self.cum else 0) - self.base

    def add(self, lines: list[Line]) -> None:
        # map/accumulate: no Python code runs per line (this is on every line's path)
        total = self.cum[-1] if self.cum else 0
        self.offsets.extend(map(_offset, lines))
        self.texts.extend(map(_text, lines))
        sizes = map(LINE_OVERHEAD.__add__, map(len, map(_text, lines)))
        self.cum.extend(islice(accumulate(sizes, initial=total), 1, None))
        self.count += len(lines)

    def split(self) -> None:
        """Turn the raw block into per-line lists (the first time a follower asks for separate lines)."""
        if self.raw is None:
            return
        texts = self.raw.decode("utf-8").split("\n")
        texts.pop()
        # offsets count bytes: a line's length in characters is its length in bytes only for ASCII
        sizes = map(len, texts if self.raw.isascii() else self.raw.split(b"\n"))
        self.raw = None
        self.count = len(texts)
        starts = accumulate(sizes, initial=0)
        self.offsets = list(map(int.__add__, starts, range(self.start, self.start + len(texts))))
        self.texts = texts
        self.cum = list(islice(accumulate(map(LINE_OVERHEAD.__add__, map(len, texts)), initial=0), 1, None))

    def drop(self, n: int) -> None:
        """Forget the ``n`` oldest live lines (a split segment only)."""
        self.head += n
        self.count -= n
        self.base = self.cum[self.head - 1] if self.head else 0
        if self.count:
            self.start = self.offsets[self.head]
        if self.head > 4096 and self.head * 2 > len(self.offsets):  # compact: drop the dead prefix at once
            del self.offsets[: self.head], self.texts[: self.head], self.cum[: self.head]
            self.head = 0

    def index(self, pos: int) -> int:
        """Index of the split line that starts at ``pos``, or -1."""
        i = bisect_left(self.offsets, pos, self.head)
        return i if i < len(self.offsets) and self.offsets[i] == pos else -1


class LineBuffer:
    """Recent split lines of one run's log: ``append`` from the watcher, ``read`` from followers."""

    def __init__(self, max_lines: int = 100_000, max_bytes: int = 8 << 20) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._segs: list[_Segment] = []
        self._lines = 0
        self._bytes = 0
        self.end = -1  # the offset after the last line; -1: nothing held yet (serve nothing)

    def reset(self, offset: int) -> None:
        """Forget every line; the watcher resumes splitting at ``offset``."""
        self._segs, self._lines, self._bytes = [], 0, 0
        self.end = offset

    def append(self, lines: Iterable[Line], end: int) -> None:
        """Add lines the watcher split (offsets increasing) and its new resume offset ``end``."""
        lines = lines if isinstance(lines, list) else list(lines)
        if lines:
            if not self._segs or self._segs[-1].raw is not None:
                self._segs.append(_Segment(lines[0].offset))
            seg = self._segs[-1]
            before = seg.size
            seg.add(lines)
            self._lines += len(lines)
            self._bytes += seg.size - before
        self.end = end
        self._trim()

    def append_block(self, block: Block, end: int) -> None:
        """Add a raw block of complete lines (kept unsplit) and the watcher's new resume offset ``end``."""
        if block.data:
            seg = _Segment(block.offset)
            seg.raw, seg.count = block.data, block.lines
            self._segs.append(seg)
            self._lines += seg.count
            self._bytes += seg.size
        self.end = end
        self._trim()

    def _trim(self) -> None:
        segs = self._segs
        while segs and (self._lines > self.max_lines or self._bytes > self.max_bytes):
            seg = segs[0]
            n = seg.count
            if seg.raw is None:  # split lines go one by one (at least one: the buffer is over a bound)
                n = max(self._lines - self.max_lines, 0)
                if self._bytes > self.max_bytes:
                    m = bisect_left(seg.cum, seg.base + self._bytes - self.max_bytes, seg.head)
                    n = max(n, m + 1 - seg.head)
            size = seg.size
            if n >= seg.count:
                del segs[0]
                self._lines -= seg.count
                self._bytes -= size
            else:
                seg.drop(n)
                self._lines -= n
                self._bytes -= size - seg.size

    def _split(self, seg: _Segment) -> None:
        before = seg.size
        seg.split()
        self._bytes += seg.size - before  # characters, not bytes, once decoded

    def __len__(self) -> int:
        return self._lines

    def _find(self, pos: int) -> tuple[int, int] | None:
        """(segment index, line index in it) of the held line that starts at ``pos``; the line index is -1
        for a raw segment (``pos`` checked to be a line start of it)."""
        k = bisect_right(self._segs, pos, key=_start) - 1  # the last segment that starts at or before pos
        if k < 0:
            return None
        seg = self._segs[k]
        if seg.raw is not None:
            at = pos - seg.start
            if at < len(seg.raw) and (at == 0 or seg.raw[at - 1] == 0x0A):
                return k, -1
            return None
        i = seg.index(pos)
        return (k, i) if i >= 0 else None

    def _after(self, k: int) -> int:
        """The offset after segment ``k``'s last line: the next segment's start, or ``end``."""
        return self._segs[k + 1].start if k + 1 < len(self._segs) else self.end

    def read(self, pos: int, max_lines: int, max_bytes: int) -> tuple[list[tuple[int, str]], int] | None:
        """Lines from stream offset ``pos`` (at most ``max_lines``, about ``max_bytes``) and the offset after
        them; ``None`` when ``pos`` is not served from memory (too old, or not a line start seen here)."""
        if pos == self.end >= 0:
            return [], pos
        found = self._find(pos)
        if found is None:
            return None
        k, i = found
        seg = self._segs[k]
        if i < 0:
            self._split(seg)
            i = seg.index(pos)
        before = seg.cum[i - 1] if i > 0 else 0
        j = min(i + max_lines, len(seg.offsets), bisect_right(seg.cum, before + max_bytes, i))
        j = max(j, i + 1)  # one over-long line still goes out alone
        nxt = seg.offsets[j] if j < len(seg.offsets) else self._after(k)
        return list(zip(seg.offsets[i:j], seg.texts[i:j], strict=True)), nxt

    def read_text(self, pos: int, max_bytes: int) -> tuple[str, int] | None:
        """The complete lines from stream offset ``pos`` as one string, each line followed by ``\\n`` (about
        ``max_bytes``, at least one line, from one segment: ask again at the offset returned), and the offset
        after them; ``("", pos)`` at ``end``; ``None`` as for ``read``.  Offsets within the text are not
        byte offsets of the log where the splitter worked on a line (cut, colour codes, ``\\r``)."""
        if pos == self.end >= 0:
            return "", pos
        found = self._find(pos)
        if found is None:
            return None
        k, i = found
        seg = self._segs[k]
        if i < 0:  # a raw block: one slice and one decode, no per-line work
            raw, at = seg.raw, pos - seg.start
            assert raw is not None
            cut = raw.rfind(b"\n", at, at + max_bytes) + 1 if at + max_bytes < len(raw) else len(raw)
            if cut <= at:  # one over-long line still goes out alone
                cut = raw.index(b"\n", at) + 1
            nxt = seg.start + cut if cut < len(raw) else self._after(k)
            return raw[at:cut].decode("utf-8"), nxt
        before = seg.cum[i - 1] if i > 0 else 0
        j = max(min(len(seg.offsets), bisect_right(seg.cum, before + max_bytes, i)), i + 1)
        nxt = seg.offsets[j] if j < len(seg.offsets) else self._after(k)
        texts = seg.texts[i:j]
        texts.append("")
        return "\n".join(texts), nxt
