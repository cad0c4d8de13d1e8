"""Decompression bombs: `eaglewatch-agent check` names them and stays in bounded memory (gzip and zstd)."""

from __future__ import annotations

import gzip
import io
import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from agent.checks.tensorfiles import MAX_RATIO, RATIO_FLOOR, SIZE_MARGIN, decompression_bound

zstd = pytest.importorskip("zstandard")

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
BOMB = 512 * MiB
#: Peak RSS a bomb may add over checking a good file of the same kind (today's code added the whole stream).
HEADROOM = 160 * MiB

# Run the real CLI as the only child of a fresh interpreter, so RUSAGE_CHILDREN is that CLI's peak RSS.
PEAK = (
    "import json, resource, subprocess, sys\n"
    "p = subprocess.run([sys.executable, '-m', 'agent', 'check', '--json', sys.argv[1]],"
    " capture_output=True, text=True, timeout=300)\n"
    "print(json.dumps({'rc': p.returncode, 'out': p.stdout, 'err': p.stderr,"
    " 'peak': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))\n"
)


def check_peak(path: Path) -> tuple[int, dict[str, object], int]:
    """(exit code, the --json report, peak RSS in bytes) of `eaglewatch-agent check --json path`."""
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(path)], cwd=REPO, capture_output=True, text=True, timeout=360
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["rc"] in (0, 1), res["err"]
    return int(res["rc"]), json.loads(res["out"]), int(res["peak"])


def _zeros(write: Callable[[bytes], object], n: int) -> None:
    chunk = bytes(MiB)
    for _ in range(n // MiB):
        write(chunk)
    write(bytes(n % MiB))


def gzip_bomb(path: Path, lie: bool = False) -> Path:
    """BOMB bytes of zeros, gzipped by streaming; lie=True zeroes the ISIZE trailer, as a 4 GiB bomb has."""
    with gzip.open(path, "wb", compresslevel=1) as f:
        _zeros(f.write, BOMB)
    if lie:
        with open(path, "r+b") as f:
            f.seek(-4, io.SEEK_END)
            f.write(b"\0\0\0\0")
    return path


def _st_prefix(t: int, layers: int, hidden: int) -> tuple[bytes, int]:
    """A safetensors header: token_ids [t], bf16 hidden_states [t, layers, hidden]; (prefix, data bytes)."""
    ids, hs = t * 8, t * layers * hidden * 2
    header = {
        "token_ids": {"dtype": "I64", "shape": [t], "data_offsets": [0, ids]},
        "hidden_states": {"dtype": "BF16", "shape": [t, layers, hidden], "data_offsets": [ids, ids + hs]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, ids + hs


def zst_bomb(path: Path, declared: bool) -> Path:
    """A safetensors file of BOMB zero bytes, zstd-compressed; declared: the frame says its size."""
    prefix, data = _st_prefix(4096, 4, BOMB // (4096 * 4 * 2))
    with open(path, "wb") as raw:
        size = len(prefix) + data if declared else -1
        with zstd.ZstdCompressor(level=3).stream_writer(raw, size=size) as w:
            w.write(prefix)
            _zeros(w.write, data)
    return path


def zst_header_bomb(path: Path) -> Path:
    """A safetensors length prefix of ~95 MB followed by that much JSON whitespace, zstd-compressed."""
    n = 95 * MiB
    with open(path, "wb") as raw, zstd.ZstdCompressor(level=3).stream_writer(raw) as w:
        w.write(struct.pack("<Q", n))
        chunk = b" " * MiB
        for _ in range(n // MiB):
            w.write(chunk)
    return path


def good_gz(path: Path) -> Path:
    buf = io.BytesIO()
    t, h = 8, 32
    torch.save(
        {
            "input_ids": torch.arange(t).unsqueeze(0),
            "loss_mask": torch.ones(1, t, dtype=torch.long),
            "hidden_state": torch.randn(1, t, h).bfloat16(),
            "aux_hidden_state": torch.randn(1, t, 3 * h).bfloat16(),
        },
        buf,
    )
    path.write_bytes(gzip.compress(buf.getvalue()))
    return path


def good_zst(path: Path) -> Path:
    data = save({"token_ids": torch.arange(8), "hidden_states": torch.randn(8, 4, 32).bfloat16()})
    path.write_bytes(zstd.ZstdCompressor().compress(data))
    return path


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Peak RSS of checking a good file, per kind: the bound is relative (torch's import alone is large)."""
    d = tmp_path_factory.mktemp("good")
    peaks = {}
    for kind, path in (("gz", good_gz(d / "data_0.ckpt.gz")), ("zst", good_zst(d / "hs_0.safetensors.zst"))):
        rc, report, peak = check_peak(path)
        assert rc == 0 and report["ok"], report
        peaks[kind] = peak
    return peaks


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "make", "kind", "says"),
    [
        ("data_0.ckpt.gz", gzip_bomb, "gz", f"{MAX_RATIO}×"),
        ("data_0.ckpt.gz", lambda p: gzip_bomb(p, lie=True), "gz", "declares"),
        ("hs_0.safetensors.zst", lambda p: zst_bomb(p, declared=False), "zst", f"{MAX_RATIO}×"),
        ("hs_0.safetensors.zst", lambda p: zst_bomb(p, declared=True), "zst", f"{MAX_RATIO}×"),
        ("hs_0.safetensors.zst", zst_header_bomb, "zst", f"{MAX_RATIO}×"),
    ],
    ids=["gzip", "gzip-lying-trailer", "zstd-streamed", "zstd-declared", "zstd-header"],
)
def test_bomb_is_named_in_bounded_memory(
    tmp_path: Path,
    baseline: dict[str, int],
    name: str,
    make: Callable[[Path], Path],
    kind: str,
    says: str,
) -> None:
    path = make(tmp_path / name)
    rc, report, peak = check_peak(path)
    assert rc == 1 and not report["ok"], report
    problems = report["problems"]
    assert isinstance(problems, list) and [p["code"] for p in problems] == ["unreadable"], problems
    message = problems[0]["message"]
    assert "a decompression bomb?" in message and says in message, message
    assert peak < baseline[kind] + HEADROOM, (peak // MiB, baseline[kind] // MiB)


@pytest.mark.parametrize(
    ("compressed", "declared", "wrap", "limit", "from_declared"),
    [
        (1000, None, None, RATIO_FLOOR, False),  # small files may always reach the floor
        (10 * RATIO_FLOOR, None, None, 10 * RATIO_FLOOR * MAX_RATIO, False),
        (1000, 5000, None, 5000 + SIZE_MARGIN, True),
        (1000, 10 * RATIO_FLOOR, None, RATIO_FLOOR, False),  # a declared size past the cap does not lift it
        (1000, 0, 1 << 32, SIZE_MARGIN, True),  # gzip ISIZE 0: 0 bytes (4 GiB is past the cap)
        (1 << 30, 100, 1 << 32, (1 << 32) * 7 + 100 + SIZE_MARGIN, True),  # ISIZE wraps: 100 + k·2^32 fits
        (1 << 30, (1 << 32) - 1, 1 << 32, (1 << 30) * MAX_RATIO, False),  # hint + margin past the cap
    ],
)
def test_bound(
    compressed: int, declared: int | None, wrap: int | None, limit: int, from_declared: bool
) -> None:
    bound = decompression_bound(compressed, declared, wrap)
    assert bound.limit == limit
    assert (bound.declared is not None) == from_declared
