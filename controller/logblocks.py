"""Pure: log blocks, the unit in which log lines travel, are stored and are published (no per-line rows).

A ``Block`` is consecutive complete lines of one run's log: their texts joined by ``\\n`` (a line's text
never holds one), the stream offset of the first line and the offset after the last.  Each line's own
offset is natural (the first line's offset plus the UTF-8 length + 1 of each line before it:
agent/protocol.py ``natural_offsets``) unless ``offsets`` lists them; that happens only where the log's
bytes and the text differ (invalid UTF-8 replaced, ANSI stripped, ``\\r\\n``, a cut line, a seam).
Stored, ``offsets`` is a little-endian int64 blob (``pack_offsets``) or NULL.  ``trim(frontier)`` keeps
the lines at or after the stored frontier: a replayed or overlapping block then adds only what is new.
Readers split a block into ``(offset, text)`` lines only when they show them.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from agent.protocol import natural_offsets


class BlockError(ValueError):
    """A log block that cannot be stored: the message names the field that is wrong."""


def pack_offsets(offsets: list[int]) -> bytes:
    """Line offsets as a little-endian int64 blob."""
    arr = array("q", offsets)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def unpack_offsets(blob: bytes) -> list[int]:
    """Inverse of pack_offsets."""
    arr = array("q")
    arr.frombytes(blob)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


@dataclass(frozen=True, slots=True)
class Block:
    """Consecutive lines of one run's log; ``offsets`` None when they are the natural ones."""

    offset: int
    next_offset: int
    text: str
    offsets: list[int] | None = None

    @classmethod
    def make(cls, offsets: list[int], text: str, next_offset: int) -> Block:
        """A block of lines starting at ``offsets`` (kept only when they are not the natural ones)."""
        if text.count("\n") != len(offsets) - 1:
            raise BlockError(f"a block of {len(offsets)} line offsets needs {len(offsets) - 1} newlines")
        natural = natural_offsets(offsets[0], text)
        return cls(offsets[0], next_offset, text, None if natural[:-1] == offsets else offsets)

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> Block:
        """The block of a ``log_block`` stream message; BlockError names what is malformed."""
        offset, nxt, text, offsets = (msg.get(k) for k in ("offset", "next_offset", "text", "offsets"))
        if type(offset) is not int or offset < 0:
            raise BlockError("log_block: 'offset' must be an integer >= 0")
        if not isinstance(text, str):
            raise BlockError("log_block: 'text' must be a string")
        if type(nxt) is not int or nxt <= offset:
            raise BlockError("log_block: 'next_offset' must be an integer after 'offset'")
        if offsets is not None:
            n = text.count("\n") + 1
            if (
                not isinstance(offsets, list)
                or len(offsets) != n
                or not all(type(o) is int for o in offsets)
                or offsets[0] != offset
                or any(b <= a for a, b in pairwise(offsets))
                or offsets[-1] >= nxt
            ):
                raise BlockError(f"log_block: 'offsets' must be {n} increasing integers from 'offset'")
        return cls(offset, nxt, text, offsets)

    @classmethod
    def from_row(cls, offset: int, next_offset: int, text: str, blob: bytes | None) -> Block:
        """A stored ``log_blocks`` row."""
        return cls(offset, next_offset, text, None if blob is None else unpack_offsets(blob))

    def to_data(self) -> dict[str, Any]:
        """What a ``log`` BusEvent carries: JSON-ready, no per-line objects."""
        return asdict(self)

    @property
    def count(self) -> int:
        """How many lines the block holds."""
        return self.text.count("\n") + 1

    def blob(self) -> bytes | None:
        """The stored form of ``offsets``."""
        return None if self.offsets is None else pack_offsets(self.offsets)

    def line_offsets(self) -> list[int]:
        """Each line's start offset."""
        return self.offsets if self.offsets is not None else natural_offsets(self.offset, self.text)[:-1]

    def lines(self) -> list[tuple[int, str]]:
        """The block's lines as ``(offset, text)``."""
        return list(zip(self.line_offsets(), self.text.split("\n"), strict=True))

    def trim(self, frontier: int) -> Block | None:
        """The lines starting at or after ``frontier`` (None when there are none)."""
        if self.offset >= frontier:
            return self
        if self.next_offset <= frontier:
            return None
        offsets = self.line_offsets()
        keep = next((i for i, o in enumerate(offsets) if o >= frontier), len(offsets))
        if keep == len(offsets):
            return None
        text = self.text.split("\n", keep)[-1]
        return Block.make(offsets[keep:], text, self.next_offset)
