"""The watcher's log ingestion: what output.log gained → LineSplitter → MilestoneEngine → journal events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from agent.logs.generations import MOVED, TRUNCATED, LogChain
from agent.logs.linebuffer import LineBuffer
from agent.logs.splitter import Block, Line, LineSplitter
from agent.milestones.engine import Milestone, MilestoneEngine, RuleError, load_rules
from agent.runs.jobspec import JobSpec
from agent.runs.summary import milestone_event
from agent.sched.logmerge import LogMerger, shard_of

log = logging.getLogger("eaglewatch.agent")
READ_CHUNK = 256 * 1024  # ~35 ms of rule work: other runs and clients are served in between


def restore_engine(spec: JobSpec, snapshot: Any, run: str) -> MilestoneEngine:
    """The run's rules engine: from a cursor's ``snapshot`` where there is one, else a fresh one."""
    try:
        rules = load_rules(extra=spec.rules, backend=spec.backend)
    except (RuleError, TypeError):  # checked at launch; a spec edited on disk falls back to built-ins
        rules = load_rules(backend=spec.backend)
    if snapshot:
        try:
            return MilestoneEngine.restore(rules, snapshot)
        except Exception:  # e.g. a snapshot from another agent version: lose an open group, not the run
            log.warning("run %s: engine snapshot not restorable; starting a fresh engine", run)
    return MilestoneEngine(rules, spec.world_size)


class LogIngest:
    """Reads the run's log from stream offset ``offset`` (line number ``line`` there) across truncation,
    replacement and rotation (``chain``); splits it once, for the rules (``engine``, whose milestones go
    to ``emit`` as journal events) and for the followers (``lines``).  ``merger``: an array job's task
    logs, merged into output.log before each read."""

    def __init__(
        self,
        chain: LogChain,
        lines: LineBuffer,
        engine: MilestoneEngine,
        offset: int,
        line: int,
        merger: LogMerger | None,
        emit: Callable[[list[dict[str, Any]]], None],
    ) -> None:
        self.chain = chain
        self.lines = lines
        self.engine = engine
        self.merger = merger
        self.splitter = LineSplitter(start_offset=offset)
        self.fed = offset  # the stream offset read up to (the splitter holds an unterminated last line)
        self.line = line  # the number of the last line the rules have taken
        self._emit = emit
        self._shard_lines: dict[int, int] = {}  # line number → shard of a merged line, for its milestones
        lines.reset(offset)

    def position(self) -> dict[str, Any]:
        """Where the rules stand, for the cursor: the offset to resume at, its line number, the engine's
        state and the log's generations."""
        return {
            "offset": self.splitter.pending_offset,
            "line": self.line,
            "engine": self.engine.snapshot(),
            "log": self.chain.snapshot(),
        }

    async def merge(self, final: bool = False) -> None:
        """Merge what an array job's task logs gained into output.log (all of it when ``final``)."""
        if self.merger is not None:
            await asyncio.to_thread(self.merger.pump, final)

    def read(self) -> tuple[int, bool]:
        """Feed the next chunk of what the log gained, at most READ_CHUNK bytes: its size (0 when nothing
        was new), and whether a seam (truncation, replacement, a rename) came first: then its warning is
        emitted after the milestones of the lines before it, and nothing else is read."""
        data, seam = self.chain.poll(self.fed, READ_CHUNK)
        if seam is not None:
            self._seam(seam)
            return 0, True
        if data:
            self.fed += len(data)
            if self.merger is None:  # complete lines stay one raw block: rules decode only likely lines
                head, block = self.splitter.feed_block(data)
            else:  # merged lines carry a shard tag each: split them one by one
                head, block = self.splitter.feed(data), None
            self._feed(head, self.splitter.pending_offset, block)
        return len(data), False

    def release(self, quiet: bool) -> bool:
        """Release the milestones the rules hold back: all of them when the log is ``quiet`` or the TP world
        is unknown (nothing says more ranks will come), else all but the rank groups still waiting for
        ranks; True when some were."""
        engine = self.engine
        released = engine.flush() if quiet or engine.world_size is None else engine.release_ready()
        self._milestones(released)
        return bool(released)

    @property
    def holding(self) -> bool:
        """Whether rank groups are still waiting for more ranks."""
        return self.engine.open_groups > 0

    def finish(self) -> None:
        """The job has ended: its unterminated last line is complete, and every held milestone goes out."""
        self._feed(self.splitter.flush(), self.splitter.pending_offset)
        self._milestones(self.engine.flush())

    def _milestones(self, milestones: list[Milestone]) -> None:
        if not milestones:
            return
        events = [{"type": "milestone", **m.to_dict()} for m in milestones]
        if self._shard_lines:
            for ev in events:
                shard = self._shard_lines.get(ev["line"])
                if shard is not None:
                    ev["fields"] = {**ev["fields"], "shard": shard}
        self._emit(events)

    def _feed(self, lines: list[Line], end: int, block: Block | None = None) -> None:
        """Split lines, then a raw block's: to the rules, then to the line buffer (``end``: where splitting
        goes on)."""
        texts = [ln.text for ln in lines]
        if self.merger is not None:  # "[shard I] " tags the merged lines: the rules see the job's own text
            for i, text in enumerate(texts):
                shard, texts[i] = shard_of(text)
                if shard is not None:
                    self._shard_lines[self.line + 1 + i] = shard
            if len(self._shard_lines) > 100_000:  # rank groups hold milestones for seconds, not this long
                keep = self.line - 50_000
                self._shard_lines = {k: v for k, v in self._shard_lines.items() if k > keep}
        self._milestones(self.engine.feed_many(texts, self.line + 1))
        self.line += len(lines)
        self.lines.append(lines, end if block is None else block.offset)
        if block is not None:
            self._milestones(self.engine.feed_block(block, self.line + 1))
            self.line += block.lines
            self.lines.append_block(block, end)

    def _seam(self, seam: str) -> None:
        """The log was truncated, replaced or renamed away: say so in the timeline, go on where it goes on."""
        cur = self.chain.current
        assert cur is not None  # a seam is only reported once a generation exists
        if seam != MOVED:
            # The old generation's unterminated last line is complete: nothing more will be added to it.
            self._feed(self.splitter.flush(), cur.base)
            self.splitter = LineSplitter(start_offset=cur.base)
            self.fed = cur.base
        if seam == TRUNCATED:
            rule, text = "log_truncated", "output.log was truncated; reading it again from its start"
        elif seam == MOVED:
            rule, text = "log_replaced", "output.log was renamed away; still following the job's file"
        else:
            rule, text = "log_replaced", "output.log was replaced by a new file; following the new file"
        self._emit(
            [milestone_event("warning", self.line, text, rule=rule, generation=cur.number, offset=cur.base)]
        )
