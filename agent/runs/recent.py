"""The journal's newest lines kept in memory: live followers take them from here, not from the file."""

from __future__ import annotations

from collections import deque

#: Bytes of the newest journal lines kept per run: a follower that fell further behind reads the file.
RECENT_BYTES = 4 << 20


class RecentLines:
    """The last writes of a journal, each as (first seq, byte offset in the file, its whole lines).

    Writes come in seq order, each a run of consecutive seqs: the lines after a follower's last seq are the
    writes from the one that starts at the next seq, when the follower's file offset is where it starts
    (a follower that read part of a write from the file, or one that is older than what is kept, reads
    the file instead)."""

    def __init__(self, end: int, limit: int = RECENT_BYTES) -> None:
        self.end = end  # the file's size: where the next write goes
        self.limit = limit
        self._writes: deque[tuple[int, int, bytes]] = deque()
        self._bytes = 0

    def add(self, first_seq: int, data: bytes) -> None:
        """A write of whole lines, seqs ``first_seq`` on, appended at ``end``."""
        if data:
            self._writes.append((first_seq, self.end, data))
            self._bytes += len(data)
            while self._bytes > self.limit and len(self._writes) > 1:
                self._bytes -= len(self._writes.popleft()[2])
        self.end += len(data)

    def after(self, seq: int, offset: int) -> tuple[bytes, int] | None:
        """The lines written after ``seq`` (a follower at byte ``offset`` of the file) and the offset past
        them; ``(b"", offset)`` when nothing was; None when this does not hold them from there."""
        if offset == self.end:
            return b"", offset
        if not self._writes or self._writes[0][0] > seq + 1:  # older than what is kept: no walk through it
            return None
        taken: list[bytes] = []
        for first, start, data in reversed(self._writes):  # a live follower wants the last write or two
            taken.append(data)
            if first <= seq + 1:
                if first == seq + 1 and start == offset:
                    taken.reverse()
                    return b"".join(taken), self.end
                return None
        return None
