"""LineSplitter: splitting, offsets, ANSI, invalid UTF-8, the line cap, and resuming at pending_offset."""

from __future__ import annotations

import tracemalloc

import pytest

from agent.logs.splitter import _ANSI_RE, Line, LineSplitter
from tests.helpers.vllm_log import make_log


def split_all(data: bytes, chunk: int | None = None, cap: int = 65536) -> list[Line]:
    """Feed ``data`` in chunks of ``chunk`` bytes (all at once when None), then flush."""
    sp = LineSplitter(max_line_bytes=cap)
    out: list[Line] = []
    step = chunk or max(len(data), 1)
    for i in range(0, len(data), step):
        out += sp.feed(data[i : i + step])
    return out + sp.flush()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"a\nb\n", [(0, "a"), (2, "b")]),
        (b"a\r\nb\r\n", [(0, "a"), (3, "b")]),
        (b"a\rb\rc\n", [(0, "a"), (2, "b"), (4, "c")]),
        (b"\n\n", [(0, ""), (1, "")]),
        (b"\r\r\n", [(0, ""), (1, "")]),
        (b"no newline", [(0, "no newline")]),
        (b"x\n\ry", [(0, "x"), (2, ""), (3, "y")]),
        (b"\x1b[32mINFO\x1b[0m 02-21 msg\n", [(0, "INFO 02-21 msg")]),
        (b"bad \xff\xfe utf8\n", [(0, "bad \ufffd\ufffd utf8")]),
        ("ünïcödé ✓\n".encode(), [(0, "ünïcödé ✓")]),
        (b"", []),
    ],
    ids=[
        "lf",
        "crlf",
        "cr-tqdm",
        "empty-lines",
        "cr-then-crlf",
        "unterminated",
        "lf-cr",
        "ansi",
        "bad-utf8",
        "utf8",
        "nothing",
    ],
)
@pytest.mark.parametrize("chunk", [None, 1, 2, 3])
def test_split_table(data: bytes, expected: list[tuple[int, str]], chunk: int | None) -> None:
    """Every terminator, any chunking: the same lines at the same offsets."""
    lines = split_all(data, chunk)
    assert [(ln.offset, ln.text) for ln in lines] == expected
    assert not any(ln.truncated for ln in lines)


@pytest.mark.parametrize("colours", [False, True])
@pytest.mark.parametrize("chunk", [None, 4096, 333])
def test_offsets_point_at_line_starts_in_a_realistic_log(colours: bool, chunk: int | None) -> None:
    """Each Line.offset is where that line's bytes start in the file (plain ASCII and coloured chunks)."""
    data = make_log(tp=4, failure="oom", colours=colours)
    lines = split_all(data, chunk=chunk)
    assert len(lines) > 50
    for ln in lines:
        raw = data[ln.offset :].split(b"\n", 1)[0].split(b"\r", 1)[0]
        assert _ANSI_RE.sub("", raw.decode()) == ln.text
        assert "\x1b" not in ln.text


def test_crlf_split_across_chunks_holds_the_line_until_the_next_byte() -> None:
    """A chunk ending in \\r keeps its line back (pending_offset at its start) until the next byte."""
    sp = LineSplitter()
    assert sp.feed(b"abc\r") == []
    assert sp.pending_offset == 0
    assert sp.feed(b"\ndef\r") == [Line(0, "abc", False)]
    assert sp.pending_offset == 5
    assert sp.feed(b"g") == [Line(5, "def", False)]
    assert sp.flush() == [Line(9, "g", False)]
    assert sp.pending_offset == 10
    assert sp.flush() == []


@pytest.mark.parametrize("cap", [4, 7, 65536])
def test_restart_at_pending_offset_loses_and_duplicates_nothing(cap: int) -> None:
    """Stop after any chunk, restart a splitter at pending_offset: the concatenation equals one pass."""
    data = b"alpha\r\nbeta\rgamma\n\xe2\x9c\x93 ok\r\n\x1b[1mbold\x1b[0m\n\ntail"
    reference = split_all(data, cap=cap)
    for cut in range(len(data) + 1):
        first = LineSplitter(max_line_bytes=cap)
        lines = first.feed(data[:cut])
        resume = first.pending_offset
        assert 0 <= resume <= cut
        second = LineSplitter(max_line_bytes=cap, start_offset=resume)
        lines += second.feed(data[resume:]) + second.flush()
        assert lines == reference, f"cut at {cut}"


def test_start_offset_shifts_offsets() -> None:
    """A splitter started at N reports offsets from N."""
    sp = LineSplitter(start_offset=1000)
    assert sp.feed(b"a\nbb\n") == [Line(1000, "a", False), Line(1002, "bb", False)]
    assert sp.pending_offset == 1005


def test_ten_megabyte_line_is_capped_while_streaming() -> None:
    """A 10 MB line fed in 64 KiB chunks is cut at the cap without ever being buffered whole."""
    size = 10 * 1024 * 1024
    big = b"x" * size
    sp = LineSplitter(max_line_bytes=65536)
    tracemalloc.start()
    try:
        out: list[Line] = []
        for i in range(0, size, 65536):
            out += sp.feed(big[i : i + 65536])
        out += sp.feed(b"\nnext line\n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024, f"peak {peak} bytes: the long line was buffered"
    assert [ln.offset for ln in out] == [0, size + 1]
    first, second = out
    assert first.truncated
    assert first.text.startswith("x" * 65536)
    assert f"{size - 65536} bytes dropped" in first.text
    assert second == Line(size + 1, "next line", False)


def test_ten_megabyte_line_in_one_chunk() -> None:
    """The same line in one feed: same result."""
    size = 10 * 1024 * 1024
    out = split_all(b"y" * size + b"\nz\n")
    assert out[0].truncated and f"{size - 65536} bytes dropped" in out[0].text
    assert out[1] == Line(size + 1, "z", False)


@pytest.mark.parametrize("middle", [b"x" * 100, "é".encode() * 50])
def test_long_line_in_the_middle_of_a_chunk(middle: bytes) -> None:
    """A capped line between short ones in one chunk (ASCII and not): offsets and texts stay right."""
    data = b"a\nb\n" + middle + b"\nc\nd\n"
    lines = split_all(data, cap=10)
    assert [(ln.offset, ln.truncated) for ln in lines] == [
        (0, False),
        (2, False),
        (4, True),
        (105, False),
        (107, False),
    ]
    assert lines[2].text.startswith(middle[:10].decode()) and "90 bytes dropped" in lines[2].text
    assert [ln.text for ln in lines[3:]] == ["c", "d"]


def test_cap_does_not_cut_a_utf8_character_in_half() -> None:
    """The kept prefix ends on a character boundary; the cut bytes count as dropped."""
    data = "é".encode() * 10 + b"\n"  # 2 bytes each
    (line,) = split_all(data, cap=5)
    assert line.truncated
    assert line.text.startswith("éé ")
    assert "\ufffd" not in line.text
    assert "16 bytes dropped" in line.text


def test_unterminated_long_line_flushes_truncated() -> None:
    """flush() emits a capped final line with its marker."""
    sp = LineSplitter(max_line_bytes=3)
    assert sp.feed(b"abcdefgh") == []
    (line,) = sp.flush()
    assert line == Line(0, "abc […line truncated: 5 bytes dropped]", True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\x1b[32mINFO\x1b[0m", "INFO"),
        ("\x1b[1;31mERROR\x1b[0m x", "ERROR x"),
        ("\x1b]0;title\x07after", "after"),
        ("\x1b[2K\x1b[1Gbar", "bar"),
        ("plain", "plain"),
    ],
)
def test_strip_ansi(text: str, expected: str) -> None:
    """Colour, erase-line and OSC title sequences go away."""
    assert LineSplitter().feed(text.encode() + b"\n")[0].text == expected


@pytest.mark.parametrize(("cap", "start"), [(0, 0), (10, -1)])
def test_bad_arguments_are_rejected(cap: int, start: int) -> None:
    """A cap below 1 or a negative start offset is a ValueError naming the argument."""
    with pytest.raises(ValueError, match=r"max_line_bytes|start_offset"):
        LineSplitter(max_line_bytes=cap, start_offset=start)
