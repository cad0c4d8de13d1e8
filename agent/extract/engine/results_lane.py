"""Taking a drain's results in on a thread of its own while the engine runs the next batch."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from agent.extract import signals


class ResultsLane:
    """Runs each drain's result-taking in order: on one background thread when ``overlap``, else inline.

    With a writer process the files no longer hold the driver, but taking their results in (checks
    reported, statistics, manifest, progress lines) did, between two batches, with the engine idle.
    Overlapped, a take runs while the driver waits in the next ``llm.generate`` for the engine core's
    process. At most one take is in flight: ``run`` and ``join`` wait for it first, so takes never overlap
    each other and the driver reads what they update only after a join; a take's error is raised there.
    ``waited_s`` is the driver's own time on takes: all of it inline, only the waits when overlapped.
    """

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self.waited_s = 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eaglewatch-results") if overlap else None
        self._pending: Future[None] | None = None

    def run(self, take: Callable[[], None], inline: bool = False) -> None:
        """Take one drain's results, behind the one in flight; ``inline``: done before returning."""
        self.join()
        if self._pool is None or inline:
            t0 = time.monotonic()
            try:
                take()
            finally:
                self.waited_s += time.monotonic() - t0
            return
        self._pending = self._pool.submit(take)

    def join(self) -> None:
        """Wait for the take in flight; its error is raised here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.monotonic()
        try:
            pending.result()
        finally:
            self.waited_s += time.monotonic() - t0

    def close(self) -> None:
        """Finish the take in flight (raising its error) and end the thread."""
        try:
            self.join()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def __enter__(self) -> ResultsLane:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        # The driver fails already: wait for the take so nothing writes after this, keep the driver's error.
        try:
            self.close()
        except Exception as also:
            signals.say(f"taking results in failed too: {type(also).__name__}: {also}")
