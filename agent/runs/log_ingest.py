"""The watcher's log ingestion: what output.log gained → LineSplitter → MilestoneEngine → journal outbox."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agent.logs.block import Block
from agent.logs.generations import MOVED, TRUNCATED, LogChain
from agent.logs.linebuffer import LineBuffer
from agent.logs.splitter import Line, LineSplitter
from agent.logs.tail import Broadcast
from agent.milestones.engine import Milestone, MilestoneEngine
from agent.runs.classifier import RemoteEngine
from agent.runs.summary import milestone_event
from agent.sched.logmerge import LogMerger, shard_of

READ_CHUNK = 256 * 1024  # ~35 ms of rule work: other runs and clients are served in between
# While catching up on a backlog: let the other runs and clients in this often (not after every read), and
# start a journal fsync (in a worker thread) then.
COMMIT_EVERY_S = 0.05


class LogIngest:
    """Mixed into RunWatcher: reading the log from where it was fed to, across truncation and rotation."""

    merger: LogMerger | None
    chain: LogChain
    fed: int
    splitter: LineSplitter
    _line: int
    lines: LineBuffer
    engine: MilestoneEngine | RemoteEngine
    log_changed: Broadcast
    _shard_lines: dict[int, int]

    def _journal_milestones(self, milestones: list[Milestone]) -> None:
        raise NotImplementedError

    def _append(self, ev: dict[str, Any]) -> None:
        raise NotImplementedError

    def _commit(self, sync: bool = True) -> None:
        raise NotImplementedError

    def _catch_up(self) -> None:
        raise NotImplementedError

    def _submit(self) -> None:
        raise NotImplementedError

    def _sync_behind(self) -> None:
        raise NotImplementedError

    def _save_cursor(self, force: bool = False) -> None:
        raise NotImplementedError

    @property
    def line(self) -> int:
        """The number of the last log line the rules have taken (with classifier children the engine numbers
        its lines as their hits come back: lines sent but not yet taken are not counted yet)."""
        engine = getattr(self, "engine", None)  # none yet while the cursor is first restored
        return engine.line if isinstance(engine, RemoteEngine) else self._line

    @line.setter
    def line(self, n: int) -> None:
        self._line = n
        engine = getattr(self, "engine", None)  # none yet while the cursor is first restored
        if isinstance(engine, RemoteEngine):
            engine.line = n

    async def _pump(self) -> bool:
        """Feed what the log gained to the splitter and the engine; True when bytes were read."""
        got = False
        if self.merger is not None:
            await asyncio.to_thread(self.merger.pump)
        started = time.monotonic()
        while True:
            data, seam = self.chain.poll(self.fed, READ_CHUNK)
            if seam is not None:
                self._log_seam(seam)
                got = True
                continue
            if not data:
                break
            got = True
            self.fed += len(data)
            if self.merger is None:  # complete lines stay one raw block: rules decode only likely lines
                head, block = self.splitter.feed_block(data, not isinstance(self.engine, RemoteEngine))
            else:  # merged lines carry a shard tag each: split them one by one
                head, block = self.splitter.feed(data), None
            self._feed_lines(head, self.splitter.pending_offset, block)
            if len(data) < READ_CHUNK:
                # Caught up: the lines' milestones are written now (not fsynced yet), encoded here with no
                # round trip: followers send lines and events together, before the fsync and cursor write.
                self._catch_up()
                self._commit(sync=False)
                # Told after the events: a live milestone goes out ahead of its own line, so on the way to the
                # page it does not queue behind that line's commit, SSE message and render.
                self.log_changed.notify()
                break
            # A backlog: its events go to the journal's encoder stage (a child on another core, where
            # EAGLEWATCH_AGENT_ENCODER starts one; else written here at once) while the next chunk is read
            # and classified; followers get the stage's events a chunk later.  A classifier child (where
            # EAGLEWATCH_AGENT_CLASSIFIER starts one) classifies this chunk meanwhile: what it has answered
            # is journaled now.
            if isinstance(self.engine, RemoteEngine):
                self.engine.poll()
            self._submit()
            self.log_changed.notify()
            now = time.monotonic()
            if now - started >= COMMIT_EVERY_S:
                # A long backlog must not starve the other runs and clients: let them in, and have the
                # journal synced meanwhile (an fsync is a wait, not work: it never holds this loop up).
                started = now
                self._sync_behind()
                await asyncio.sleep(0)
        if got:
            # Followers send the new events while the disk syncs them (an fsync can take tens of ms), and
            # the cursor is written only after it.
            self._catch_up()
            self._sync_behind()
        return got

    def _feed_lines(self, lines: list[Line], end: int, block: Block | None = None) -> None:
        """Split lines, then a raw block's: to the rules, then to the line buffer (``end``: where splitting
        goes on); the caller tells the log followers."""
        texts = [ln.text for ln in lines]
        if self.merger is not None:  # "[shard I] " tags the merged lines: the rules see the job's own text
            for i, text in enumerate(texts):
                shard, texts[i] = shard_of(text)
                if shard is not None:
                    self._shard_lines[self.line + 1 + i] = shard
            if len(self._shard_lines) > 100_000:  # rank groups hold milestones for seconds, not this long
                keep = self.line - 50_000
                self._shard_lines = {k: v for k, v in self._shard_lines.items() if k > keep}
        engine = self.engine
        if isinstance(engine, RemoteEngine):  # it numbers the lines in their turn
            self._journal_milestones(engine.feed_many(texts))
        else:
            self._journal_milestones(engine.feed_many(texts, self._line + 1))
            self._line += len(lines)
        self.lines.append(lines, end if block is None else block.offset)
        if block is not None:
            if isinstance(engine, RemoteEngine):
                self._journal_milestones(engine.feed_block(block))
            else:
                self._journal_milestones(engine.feed_block(block, self._line + 1))
                self._line += block.lines
            self.lines.append_block(block, end)

    def _log_seam(self, seam: str) -> None:
        """The log was truncated, replaced or renamed away: say so in the timeline, go on where it goes on."""
        cur = self.chain.current
        assert cur is not None  # a seam is only reported once a generation exists
        if seam != MOVED:
            # The old generation's unterminated last line is complete: nothing more will be added to it.
            self._feed_lines(self.splitter.flush(), cur.base)
            self.splitter = LineSplitter(start_offset=cur.base)
            self.fed = cur.base
        if seam == TRUNCATED:
            rule, text = "log_truncated", "output.log was truncated; reading it again from its start"
        elif seam == MOVED:
            rule, text = "log_replaced", "output.log was renamed away; still following the job's file"
        else:
            rule, text = "log_replaced", "output.log was replaced by a new file; following the new file"
        self._catch_up()  # the milestones of the lines before the seam come before its warning
        self._append(
            milestone_event("warning", self.line, text, rule=rule, generation=cur.number, offset=cur.base)
        )
        self._save_cursor(force=True)
        self.log_changed.notify()
