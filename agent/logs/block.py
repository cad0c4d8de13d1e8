"""Raw blocks of complete log lines: split, counted and served without a Python object per line."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

#: ASCII digits folded to ``0``: a line's shape (same length as the line; the rules' prefilter key).
DIGIT_FOLD = bytes.maketrans(b"123456789", b"000000000")


@dataclass(frozen=True, slots=True)
class Block:
    """Complete lines kept as raw bytes: ``data`` holds them, each ended by ``\\n``, from stream ``offset``.

    Every line is valid UTF-8 with no ``\\r``, no escape byte and at most the cap, so its text is its bytes
    decoded. ``shapes`` holds each line's bytes with ASCII digits folded to ``0`` (``DIGIT_FOLD``): one C
    split of the whole block, which gives the lines' count and lengths without decoding anything.
    """

    offset: int
    data: bytes
    shapes: list[bytes]

    @property
    def lines(self) -> int:
        """How many lines the block holds."""
        return len(self.shapes)

    @property
    def end(self) -> int:
        """The offset after the block's last line."""
        return self.offset + len(self.data)

    def texts(self) -> list[str]:
        """Every line's text (one decode and one split in C)."""
        texts = self.data.decode("utf-8").split("\n")
        texts.pop()
        return texts


def clean_block(data: bytes, offset: int, max_line_bytes: int) -> Block | None:
    """``data`` (complete lines, ending in ``\\n``) as a Block, or None when some line needs the splitter."""
    if b"\r" in data or b"\x1b" in data:
        return None
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return None
    shapes = data.translate(DIGIT_FOLD).split(b"\n")
    shapes.pop()
    if (
        len(data) > max_line_bytes
        and not _short_lines(data, max_line_bytes)
        and max(map(len, shapes)) > max_line_bytes
    ):
        return None
    return Block(offset, data, shapes)


def _short_lines(data: bytes, cap: int) -> bool:
    """True when every line of ``data`` is surely shorter than ``cap`` bytes: each aligned window of
    ``cap // 2`` bytes holds a newline, so a line (which starts in one window and ends by the end of the
    next) has at most ``2 * (cap // 2) - 1`` bytes.  A few C searches instead of a pass over every line;
    False only means "look at each line"."""
    step = cap // 2
    if step < 1:
        return False
    find = data.find
    return all(find(b"\n", at, at + step) >= 0 for at in range(0, len(data), step))


class BlockLines(Sequence[str]):
    """The texts of a Block's lines, decoded one by one when asked for (cheapest in ascending order)."""

    def __init__(self, block: Block) -> None:
        self._data = block.data
        self._shapes = block.shapes
        self._i = 0  # the line whose start is _at
        self._at = 0

    def __len__(self) -> int:
        return len(self._shapes)

    def _text(self, i: int) -> str:
        if i < 0:
            i += len(self._shapes)
        if not 0 <= i < len(self._shapes):
            raise IndexError(i)
        if i < self._i:
            self._i = self._at = 0
        if i > self._i:  # the lengths of the lines between, summed in C
            self._at += sum(map(len, self._shapes[self._i : i])) + (i - self._i)
            self._i = i
        size = len(self._shapes[i])
        return self._data[self._at : self._at + size].decode("utf-8")

    def texts_at(self, indices: Sequence[int]) -> list[str]:
        """The texts of the lines ``indices`` (ascending): each line's start summed from the lengths of the
        lines before it in C, a decode per line asked for."""
        data, shapes, out = self._data, self._shapes, []
        at = prev = 0
        for i in indices:
            if i > prev:
                at += sum(map(len, shapes[prev:i])) + (i - prev)
            end = at + len(shapes[i])
            out.append(data[at:end].decode("utf-8"))
            at, prev = end + 1, i + 1
        return out

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._text(j) for j in range(*i.indices(len(self)))]
        return self._text(i)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data.decode("utf-8").split("\n")[:-1])
