"""A run's log as a chain of generations, followed like ``tail -F``: by inode, and by name when replaced.

A generation is one stretch of output.log: one file (device, inode) from one start.  A ``truncate`` starts a
new generation on the same inode; a new, non-empty file at the name (the old one renamed away, as logrotate
does) starts one on the new inode once the old one is read to its end.  Generation 0 is the file's own byte
offsets and each later one continues where the previous ended (``base``): stream offsets (architecture.md).
Only the watcher moves the chain (``poll``); log streams read it (``read_at``); the cursor persists it.

A renamed log with nothing at the name, or an empty new file there, is still the job's log: its stdout is
the renamed inode, so the chain keeps reading that one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: What ``poll`` saw happen to the log besides data.
TRUNCATED = "truncated"
REPLACED = "replaced"
MOVED = "moved"


@dataclass
class Generation:
    """One stretch of the log: its file identity, where it starts in stream offsets and (once closed) ends."""

    number: int
    base: int
    dev: int
    ino: int
    end: int | None = None
    lost: bool = False  # truncated: the bytes it held were overwritten
    moved: bool = False  # its name was seen pointing elsewhere (reported once)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Generation:
        """A generation from its cursor form; ValueError/TypeError/KeyError when malformed."""
        number, base, dev, ino = (int(d[k]) for k in ("number", "base", "dev", "ino"))
        end = None if d.get("end") is None else int(d["end"])
        return cls(number, base, dev, ino, end, bool(d.get("lost", False)), bool(d.get("moved", False)))


@dataclass
class Chunk:
    """What a reader got: ``data`` starting at stream offset ``offset``; ``jumped`` when it crossed a seam."""

    data: bytes
    offset: int
    jumped: bool
    at_end: bool  # nothing more to read right now in the last generation


class LogChain:
    """The generations of one run's log and descriptors open on them (reopened by name or /proc)."""

    def __init__(self, path: Path, gens: list[Generation], job_pid: Callable[[], int | None]) -> None:
        self.path = path
        self.gens = gens
        self._job_pid = job_pid
        self._fds: dict[int, int] = {}

    @classmethod
    def restore(cls, path: Path, data: Any, job_pid: Callable[[], int | None]) -> LogChain:
        """The chain saved in a cursor (an absent or unreadable one: no generation seen yet)."""
        gens: list[Generation] = []
        if isinstance(data, list):
            try:
                gens = [Generation.from_dict(d) for d in data]
            except (KeyError, TypeError, ValueError, AttributeError):
                gens = []
        return cls(path, gens, job_pid)

    def snapshot(self) -> list[dict[str, Any]]:
        """The cursor form of the chain."""
        return [asdict(g) for g in self.gens]

    @property
    def current(self) -> Generation | None:
        """The generation being written now (None before the log exists)."""
        return self.gens[-1] if self.gens else None

    def end_offset(self) -> int:
        """The stream offset just past the log's last byte (what ``status`` reports as ``log_size``)."""
        cur = self.current
        if cur is None:
            try:
                return self.path.stat().st_size
            except OSError:
                return 0
        fd = self.fd(cur)
        if fd is None:
            return cur.base
        with contextlib.suppress(OSError):
            return cur.base + os.fstat(fd).st_size
        return cur.base

    # --- descriptors ---------------------------------------------------------------------------
    def fd(self, gen: Generation) -> int | None:
        """An open descriptor on ``gen``'s file, if that file can still be reached."""
        if gen.lost:
            return None
        fd = self._fds.get(gen.number)
        if fd is not None:
            return fd
        fd = self._open_identity(gen.dev, gen.ino)
        if fd is not None:
            self._fds[gen.number] = fd
        return fd

    def _open_identity(self, dev: int, ino: int) -> int | None:
        """Open the file (dev, ino): at the log's name, as the job's stdout/stderr in /proc, or renamed
        beside it (``output.log.1``: where logrotate puts it, found again after a daemon restart)."""
        candidates = [str(self.path)]
        pid = self._job_pid()
        if pid is not None:
            candidates += [f"/proc/{pid}/fd/1", f"/proc/{pid}/fd/2"]
        with contextlib.suppress(OSError):
            candidates += sorted(
                str(p) for p in self.path.parent.iterdir() if p.name.startswith(self.path.name + ".")
            )
        for cand in candidates:
            try:
                fd = os.open(cand, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (dev, ino):
                return fd
            os.close(fd)
        return None

    def close(self, keep_unnamed: bool = False) -> None:
        """Close the descriptors (``keep_unnamed``: keep those no longer reachable by the log's name)."""
        named: tuple[int, int] | None = None
        if keep_unnamed:
            with contextlib.suppress(OSError):
                st = self.path.stat()
                named = (st.st_dev, st.st_ino)
        for number, fd in list(self._fds.items()):
            gen = next((g for g in self.gens if g.number == number), None)
            if keep_unnamed and gen is not None and (gen.dev, gen.ino) != named:
                continue
            self._fds.pop(number, None)
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- the watcher's side --------------------------------------------------------------------
    def poll(self, fed: int, max_bytes: int) -> tuple[bytes, str | None]:
        """Up to ``max_bytes`` at stream offset ``fed`` of the current generation, or what happened instead.

        Returns (data, None), (b"", None) at the end, or (b"", TRUNCATED | REPLACED | MOVED) after moving
        the chain: the caller ends the old generation's pending line and goes on from ``current.base``.
        """
        cur = self.current
        if cur is None:
            try:
                st = self.path.stat()
            except FileNotFoundError:
                return b"", None
            # An old cursor (offsets only) continues in generation 0 at its plain byte offset.
            self.gens.append(Generation(0, 0, st.st_dev, st.st_ino))
            cur = self.gens[-1]
        fd = self.fd(cur)
        if fd is None:  # replaced while no daemon held it open, and the job no longer has it
            return self._switch_to_name(fed)
        size = os.fstat(fd).st_size
        phys = fed - cur.base
        if size < phys:
            cur.end, cur.lost = fed, True
            self._fds.pop(cur.number, None)
            self.gens.append(Generation(cur.number + 1, fed, cur.dev, cur.ino))
            self._fds[cur.number + 1] = fd
            return b"", TRUNCATED
        if size > phys:
            return os.pread(fd, min(max_bytes, size - phys), phys), None
        named: os.stat_result | None
        try:
            named = self.path.stat()
        except FileNotFoundError:
            named = None
        moved = named is None or (named.st_dev, named.st_ino) != (cur.dev, cur.ino)
        if moved and named is not None and named.st_size > 0:
            return self._switch_to_name(fed)
        if moved and not cur.moved:
            cur.moved = True
            return b"", MOVED
        return b"", None

    def _switch_to_name(self, fed: int) -> tuple[bytes, str | None]:
        """Start a generation on the file now at the log's name (the old one was read to its end)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return b"", None
        st = os.fstat(fd)
        cur = self.current
        number = 0 if cur is None else cur.number + 1
        if cur is not None:
            cur.end = fed
        self.gens.append(Generation(number, fed, st.st_dev, st.st_ino))
        self._fds[number] = fd
        return b"", REPLACED

    # --- the readers' side ---------------------------------------------------------------------
    def read_at(self, offset: int, max_bytes: int) -> Chunk:
        """Bytes at stream ``offset``; skips (``jumped``) to the next generation past an ended or lost one."""
        gens = self.gens or self._transient()
        if not gens:
            return Chunk(b"", offset, False, True)
        jumped = False
        if offset < gens[0].base:
            offset, jumped = gens[0].base, True
        first = max(k for k, g in enumerate(gens) if g.base <= offset)
        for i in range(first, len(gens)):
            gen, last = gens[i], i == len(gens) - 1
            if i > first:
                offset, jumped = gen.base, True
            if not last and gen.end is not None and offset >= gen.end:
                continue
            fd = self.fd(gen)
            if fd is None:
                continue
            phys = offset - gen.base
            try:
                size = os.fstat(fd).st_size
            except OSError:
                return Chunk(b"", offset, jumped, True)
            stop = size if last or gen.end is None else min(size, gen.end - gen.base)
            if stop > phys:
                return Chunk(os.pread(fd, min(max_bytes, stop - phys), phys), offset, jumped, False)
        # at the end, or truncated and not yet seen by the watcher: wait for it
        return Chunk(b"", offset, jumped, True)

    def _transient(self) -> list[Generation]:
        """A log no watcher has polled yet (or an ended run of an older agent): its file as generation 0."""
        try:
            st = self.path.stat()
        except OSError:
            return []
        return [Generation(0, 0, st.st_dev, st.st_ino)]
