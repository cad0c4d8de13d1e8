"""The stateless half of classifying a raw block: which of its lines may match, found without the engine's
state (the prefilter's answers per line shape are a cache), so that another process can find them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

from agent.logs.block import DIGIT_FOLD, Block, BlockLines
from agent.milestones.logline import Prefilter


@dataclass(frozen=True, slots=True)
class Found:
    """A block's lines that may match: their indices (ascending), shapes and texts; ``count``: its lines."""

    count: int
    hits: list[int]
    keys: list[bytes]
    texts: list[str]

    def to_tuple(self) -> tuple[int, list[int], list[bytes], list[str]]:
        """Its fields as built-in types (what marshal carries between processes)."""
        return self.count, self.hits, self.keys, self.texts


def find(prefilter: Prefilter, data: bytes, shapes: list[bytes] | None = None) -> Found:
    """The lines of ``data`` (complete lines, each ending in ``\\n``) that may pass ``prefilter`` (a usable
    one); ``shapes``: the lines' shapes where they are at hand (block.py), else folded here in C."""
    if shapes is None:
        shapes = data.translate(DIGIT_FOLD).split(b"\n")
        shapes.pop()
    hits = prefilter.hits_of(shapes)
    texts = BlockLines(Block(0, data, shapes)).texts_at(hits)
    return Found(len(shapes), hits, [shapes[h] for h in hits], texts)


class RawLines(Sequence[str]):
    """Every line of a raw block, decoded all at once when first asked for: only an open traceback reads
    lines that were not found likely to match, and a block holds few of those."""

    def __init__(self, data: bytes, count: int) -> None:
        self._data = data
        self._count = count
        self._texts: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if self._texts is None:
            texts = self._data.decode("utf-8").split("\n")
            texts.pop()
            if len(texts) != self._count:
                raise ValueError(f"a block said to hold {self._count} lines holds {len(texts)}")
            self._texts = texts
        return self._texts[i]
