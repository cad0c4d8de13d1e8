"""The watcher's rules split with a classifier child (classifier.py): moving half of them there, and back."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from agent.logs.block import Block
from agent.logs.linebuffer import LineBuffer
from agent.milestones.engine import Milestone, MilestoneEngine, RuleSet
from agent.runs.classifier import ClassifierError, OnSnapshot, RemoteEngine, classifier_wanted
from agent.runs.jobspec import JobSpec
from agent.sched.logmerge import LogMerger

log = logging.getLogger("eaglewatch.agent")


class ChildRules:
    """Mixed into RunWatcher, first of its bases (its ``_catch_up`` is the one the others declare): which
    process runs the milestone rules."""

    engine: MilestoneEngine | RemoteEngine
    line: int
    lines: LineBuffer
    spec: JobSpec
    merger: LogMerger | None
    _rules: RuleSet
    _in_daemon: bool  # a classifier child failed: the rules stay in the daemon's process
    _skip: Counter[tuple[Any, ...]]
    # CursorKeeper's, later in RunWatcher's bases: declared, not defined, so that it is the one found.
    _snapshot_reached: OnSnapshot

    def _journal_milestones(self, milestones: list[Milestone]) -> None:
        raise NotImplementedError

    def _commit(self, sync: bool = True) -> None:
        raise NotImplementedError

    def _restore_cursor(self) -> None:
        raise NotImplementedError

    def _go_remote(self) -> None:
        """Move the rules into a classifier child where one is wanted (not for a merged array log, whose
        lines carry a shard tag each)."""
        try:
            wanted = classifier_wanted()
        except ValueError as exc:
            log.warning("%s; classifying in the daemon", exc)
            wanted = False
        engine = self.engine
        if not wanted or self.merger is not None or self._in_daemon or isinstance(engine, RemoteEngine):
            return
        if not engine.prefilter.usable:  # every line goes to the rules: nothing for a child to find
            return
        self.engine = RemoteEngine(
            engine,
            self.spec.rules,
            self.spec.backend,
            self._journal_milestones,
            self._snapshot_reached,
            self._block_counted,
            self.line,
        )

    def _block_counted(self, block: Block, lines: int) -> None:
        """A block sent to a classifier child uncounted held ``lines`` lines: the line buffer learns it."""
        self.lines.count_block(block.offset, lines)

    def _catch_up(self) -> None:
        """Take in every milestone a classifier child still owes (a no-op for rules in the daemon)."""
        if isinstance(self.engine, RemoteEngine):
            self.engine.drain()

    def _close_child(self) -> None:
        """End the classifier child, if any, once the engine has taken every block sent (the run's end, a
        stop); if the child fails meanwhile, the engine starts afresh, as it would have from a lost child."""
        engine = self.engine
        if not isinstance(engine, RemoteEngine):
            return
        try:
            engine.drain()
            self.engine, self.line = engine.engine, engine.line
        except ClassifierError:
            self.engine, self.line = MilestoneEngine(self._rules), engine.line + engine.lines_not_taken()
        engine.close()

    def _child_failed(self) -> None:
        """The blocks the classifier child had not answered are lost with it: go back to the cursor with the
        rules in the daemon, as a restarted daemon would; what the journal already holds past the cursor is
        recognised and skipped."""
        if isinstance(self.engine, RemoteEngine):
            self.engine.close()
        self._in_daemon = True
        self._commit()
        self._skip.clear()
        self._restore_cursor()
