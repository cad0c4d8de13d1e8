"""Pure milestone engine: already-split log lines in, milestones out (rule data in rules/*.toml beside it).

docs/milestones.md says what it makes of a log.  A cheap gate (logline.py), remembered per line shape,
stops most lines; those that pass are parsed (logline.py) and matched against the rules in order
(rulefile.py), by a shape's plan where one serves (plans.py).  Helpers: groups.py (rank dedupe),
tracebacks.py, records.py (JSON records, one-record exceptions, markers), rootcause.py.  A line whose
processing raises becomes a ``warning`` (``fields.rule`` = ``line_error``) and the engine goes on.

Milestones are released in line order: one that follows an open group or traceback waits for it, so the
daemon calls ``flush()`` when the log has been idle for a second and at job end.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from agent.logs.splitter import Block, BlockLines
from agent.milestones import tracebacks
from agent.milestones.groups import RankGroups
from agent.milestones.logline import (
    Gate,
    LineLayout,
    ParsedLine,
    Prefilter,
    line_layout,
    parse_line,
    process_tag,
)
from agent.milestones.milestone import Milestone
from agent.milestones.plans import ShapePlan, ShapePlans
from agent.milestones.records import json_record_lines, marker_milestone, record_exception
from agent.milestones.regex_safety import MAX_USER_TEXT
from agent.milestones.rootcause import RootCauses
from agent.milestones.rulefile import Rule, RuleError, RuleSet, load_rules

__all__ = ["Milestone", "MilestoneEngine", "RuleError", "RuleSet", "load_rules", "parse_line"]

TRACEBACK_START = tracebacks.TRACEBACK_START
DEFAULT_WINDOW = 200

_UNSEEN: Any = object()  # a shape without a plan yet


def _may_matter(text: str) -> bool:
    """Whether a line that no rule can match may still make a milestone (``_classify`` without rules):
    a traceback's first line, or an ERROR/CRITICAL record holding an exception.  The same for a line and
    its shape (digits folded): the header's and prefix's digits are ``\\d`` in their patterns."""
    return TRACEBACK_START in text or parse_line(text).level in ("ERROR", "CRITICAL")


def _tagged(out: list[Milestone]) -> list[Milestone]:
    """A two-process job's lines carry their process: ``fields.process`` says which."""
    for ms in out:
        if ms.text[:1] != "[":  # every tag starts so: most milestones need no regex
            continue
        tag = process_tag(ms.text)
        if tag is not None:
            ms.fields.setdefault("process", tag)
    return out


#: Rules whose line vLLM also prints when it shuts down after a job's normal end: fatal before the job's
#: completion marker, a ``normal_shutdown`` info milestone (no error class) after it.
SHUTDOWN_RULES = frozenset({"engine_core_died"})


class MilestoneEngine:
    """Turns one already-split line at a time into milestones; see the module docstring."""

    def __init__(self, rules: RuleSet, world_size: int | None = None, window: int = DEFAULT_WINDOW) -> None:
        self.rules = rules
        self.world_size = world_size
        self.window = window
        # ERROR lines pass the gate: one may hold an exception that no rule names.
        self._gate = Gate(rules, (TRACEBACK_START, " ERROR "))
        self._prefilter = Prefilter(self._gate, _may_matter)
        self._shapes = self._prefilter.usable  # the gate's answers can be remembered per line shape
        self._plans = ShapePlans()  # per shape: the rule that matches and where the line's parts lie
        self._error_rules = [r for r in rules.rules if r.kind == "error"]
        self._rank_groups = RankGroups()
        self._groups = self._rank_groups.open  # the same dict: the hot path tests it for open groups
        self._traces: dict[str, tracebacks.Trace] = {}
        self._held: list[Milestone] = []
        self._fired: set[str] = set()  # names of ``once`` rules that already fired
        self._roots = RootCauses()
        self._completed = False  # the job printed its completion marker: later shutdown noise is normal

    # ---- public API -------------------------------------------------------------------------------
    def feed(self, text: str, line: int) -> list[Milestone]:
        """Process one line (1-based number ``line``); return the milestones released by it."""
        if text[:1] == "{" and (parts := json_record_lines(text)) is not None:
            out: list[Milestone] = []
            for part in parts:  # a record's lines all carry the record's line number
                try:
                    out += self._feed(part, line)
                except Exception as exc:
                    out += self._line_error(part, line, exc)
            return self._roots.annotate(out)
        try:
            out = self._feed(text, line)
        except Exception as exc:
            out = self._line_error(text, line, exc)
        return self._roots.annotate(out) if out else out  # most lines release nothing

    def _line_error(self, text: str, line: int, exc: Exception) -> list[Milestone]:
        """The watcher has already read past this line: a warning, and never lose the next ones."""
        problem = f"{type(exc).__name__}: {exc}"[:500]
        fields = {"rule": "line_error", "severity": "warning", "problem": problem}
        self._held.append(Milestone("warning", line, None, fields, text))
        return self._release()

    def feed_many(self, texts: Sequence[str], first: int) -> list[Milestone]:
        """``feed`` each line (numbered from ``first``) in turn, skipping lines no rule can match in bulk.

        Same milestones in the same order as calling ``feed`` line by line (tests/agent/test_prefilter.py):
        a skipped line could only expire open groups, which the next fed line (or the end of the batch)
        expires just the same; while a traceback is open every line goes through ``feed``.
        """
        if not self._prefilter.usable:
            return [m for i, text in enumerate(texts) for m in self.feed(text, first + i)]
        keys = self._prefilter.keys(texts)
        hits = self._prefilter.hits_of(keys)
        hit_texts = texts if len(hits) == len(texts) else [texts[h] for h in hits]
        return self._feed_hits(texts, hits, [keys[h] for h in hits], hit_texts, first)

    def feed_block(self, block: Block, first: int) -> list[Milestone]:
        """``feed_many`` for a Block of raw lines: only the lines that may match are ever decoded."""
        if not self._prefilter.usable:
            return self.feed_many(block.texts(), first)
        shapes = block.shapes
        hits = self._prefilter.hits_of(shapes)
        lines = BlockLines(block)
        return self._feed_hits(lines, hits, [shapes[h] for h in hits], lines.texts_at(hits), first)

    def _feed_hits(
        self,
        texts: Sequence[str],
        hits: list[int],
        hit_keys: Sequence[bytes],
        hit_texts: Sequence[str],
        first: int,
    ) -> list[Milestone]:
        """Feed the lines ``hits`` of ``texts`` (their shapes ``hit_keys``, their texts ``hit_texts``), and
        every line while a traceback is open."""
        out: list[Milestone] = []
        feed, feed_shaped, traces, n, i = self.feed, self._feed_shaped, self._traces, len(texts), 0
        j, n_hits = 0, len(hits)
        while i < n:
            if traces:  # an open traceback sees every line (its process's frames and exception)
                out += feed(texts[i], first + i)
                i += 1
                continue
            while j < n_hits and hits[j] < i:
                j += 1  # fed already, while a traceback was open
            if j >= n_hits:
                break
            h = hits[j]
            out += feed_shaped(hit_texts[j], hit_keys[j], first + h)
            j += 1
            i = h + 1
        if i < n and (self._groups or self._held):
            self._expire(first + n - 1)  # what the skipped last line would have expired and released
            out += self._release()
        return out

    def _feed_shaped(self, text: str, key: bytes, line: int) -> list[Milestone]:
        """``feed`` of a line whose shape is ``key``: a known shape runs its plan (plans.py): its remembered
        rule, at its remembered spans when the rule treats all digits alike, else verified by one match."""
        if self._groups or self._traces or text[:1] == "{":
            return self.feed(text, line)
        try:
            plan = self._plans.plans.get(key, _UNSEEN)
            if plan is _UNSEEN:
                plan = self._learn(text, key)
            if plan is None or (rule := plan.rule) is None:
                out = self._feed(text, line) if plan is None else self._release() if self._held else []
                return self._roots.annotate(out) if out else out
            regs = plan.regs
            if regs is None:
                msg = text[plan.layout.message :]
                m = rule.regex.search(msg[:MAX_USER_TEXT] if rule.user else msg)
                if m is None:  # the rule names a digit this line lacks: search every candidate
                    return self._roots.annotate(self._feed(text, line))
                text_at, regs = m.string, m.regs
            else:
                text_at = text
            if rule.once:
                if rule.name in self._fired:
                    return self._release() if self._held else []
                self._fired.add(rule.name)
            rank = None if plan.rank is None else int(text[plan.rank[0] : plan.rank[1]])
            if rule.marker:
                start, end = regs[plan.json]
                ms = marker_milestone(rule, text_at[start:end] if start >= 0 else None, text, line, rank)
            else:
                fields = plan.build(text_at, regs)
                if rule.per_rank or (self.world_size is None and "world_size" in fields):
                    self._emit(
                        rule, fields, text, line, rank, plan.layout.proc(text) if rule.per_rank else ""
                    )
                    return self._roots.annotate(self._release())
                ms = self._milestone(rule, fields, text, line, rank)
            self._completed = self._completed or ms.kind == "completed"
            if self._held:
                self._held.append(ms)
                return self._roots.annotate(self._release())
            # nothing held, no group or traceback open: released at once
            out = _tagged([ms]) if text[:1] == "[" else [ms]
            return self._roots.annotate(out) if ms.kind == "error" else out
        except Exception as exc:
            return self._roots.annotate(self._line_error(text, line, exc))

    def _learn(self, text: str, key: bytes) -> ShapePlan | None:
        """The plan of shape ``key`` from its line ``text`` (no effects: the line is classified after)."""
        rules = self._prefilter.rules_for(text)  # records whether the shape is answered line by line
        if self._prefilter.per_line(key):
            rules = None  # this line's candidates are not its shape's
        found = line_layout(text)
        layout: LineLayout | None = found
        msg = text[found.message :]
        matched = m = None
        if rules is None or msg.lstrip().startswith(TRACEBACK_START):
            layout, rules = None, []
        for i, rule in enumerate(rules or ()):
            m = rule.regex.search(msg[:MAX_USER_TEXT] if rule.user else msg)
            if m is not None:
                matched = i
                break
        if matched is None and layout is not None and layout.level in ("ERROR", "CRITICAL"):
            layout = None  # the line may hold an exception that no rule names (record_exception)
        return self._plans.learn(key, layout, rules or [], matched, m)

    def _feed(self, text: str, line: int) -> list[Milestone]:
        if self._groups or self._traces:
            self._expire(line)
            if self._traces:
                parsed = parse_line(text)
                trace = self._traces.get(parsed.proc)
                if trace is not None:
                    step = tracebacks.take(trace, parsed.message, text, line)
                    if step != "taken":
                        self._close_trace(trace.proc)
                    if step != "ended":  # else the traceback ended before this line
                        return self._release()
                return self._classify(text, line, parsed)
        if self._shapes:
            rules = self._prefilter.rules_for(text)
            if rules is None:
                return self._release() if self._held else []
            return self._classify(text, line, None, rules)
        if not self._gate.passes(text):
            return self._release() if self._held else []
        return self._classify(text, line, None)

    def flush(self) -> list[Milestone]:
        """Close every open group and traceback; release all held milestones."""
        for proc in list(self._traces):
            self._close_trace(proc)
        self._held += self._rank_groups.close_all(self.world_size)
        return self._roots.annotate(self._release())

    def release_ready(self) -> list[Milestone]:
        """Close tracebacks and release every held milestone, but keep rank groups open.

        For a quiet log: the ranks of a large TP world print the same line seconds apart on a real GPU
        host, so an idle second must not split one milestone per rank. A group released later carries
        its first line's number, which may then be lower than milestones released before it.
        """
        for proc in list(self._traces):
            self._close_trace(proc)
        out = sorted(self._held, key=lambda m: m.line)
        self._held = []
        return self._roots.annotate(_tagged(out))

    @property
    def open_groups(self) -> int:
        """Rank groups still waiting for more ranks."""
        return len(self._groups)

    def snapshot(self) -> dict[str, Any]:
        """JSON-serialisable state (open groups, tracebacks, held milestones) for a daemon restart."""
        return {
            "world_size": self.world_size,
            "groups": self._rank_groups.snapshot(),
            "traces": [asdict(t) for t in self._traces.values()],
            "held": [m.to_dict() for m in self._held],
            "fired": sorted(self._fired),
            "roots": self._roots.snapshot(),
            "completed": self._completed,
        }

    @classmethod
    def restore(cls, rules: RuleSet, snap: dict[str, Any]) -> MilestoneEngine:
        """Rebuild an engine from ``snapshot()``'s output; malformed parts (another version's) are skipped."""
        ws = snap.get("world_size") if isinstance(snap, dict) else None
        eng = cls(rules, world_size=ws if isinstance(ws, int) else None)
        if not isinstance(snap, dict):
            return eng
        bad = (KeyError, TypeError, ValueError, AttributeError)
        eng._rank_groups.restore(snap.get("groups"))
        for t in snap.get("traces", []):
            try:
                eng._traces[t["proc"]] = tracebacks.Trace(**t)
            except bad:
                continue
        for m in snap.get("held", []):
            try:
                eng._held.append(Milestone.from_dict(m))
            except bad:
                continue
        eng._fired = {f for f in snap.get("fired", []) if isinstance(f, str)}
        eng._roots.restore(snap.get("roots"))
        eng._completed = snap.get("completed") is True
        return eng

    # ---- classification -----------------------------------------------------------------------------
    def _classify(
        self, text: str, line: int, parsed: ParsedLine | None, rules: list[Rule] | None = None
    ) -> list[Milestone]:
        if parsed is None:
            parsed = parse_line(text)
        msg = parsed.message
        trace = tracebacks.opened(msg, line, parsed.rank, parsed.proc)
        if trace is not None:
            self._traces[parsed.proc] = trace
            return self._release()
        if rules is None:
            rules = (self._prefilter.rules_for(text) or []) if self._shapes else self._gate.candidates(text)
        for rule in rules:
            m = rule.regex.search(msg[:MAX_USER_TEXT] if rule.user else msg)
            if m is not None:
                if rule.once:
                    if rule.name in self._fired:
                        break
                    self._fired.add(rule.name)
                if rule.marker:
                    ms = marker_milestone(rule, m.group("json"), text, line, parsed.rank)
                    self._completed = self._completed or ms.kind == "completed"
                    self._held.append(ms)
                else:
                    self._emit(rule, self._fields(rule, m), text, line, parsed.rank, parsed.proc)
                break
        else:
            exc = record_exception(parsed)
            if exc is not None:
                self._exception(Milestone("error", line, parsed.rank, {}, text), [exc], parsed.proc)
        return self._release()

    def _fields(self, rule: Rule, m: re.Match[str]) -> dict[str, Any]:
        return self._plans.builder(rule)(m.string, m.regs)

    def _emit(
        self, rule: Rule, fields: dict[str, Any], text: str, line: int, rank: int | None, proc: str
    ) -> None:
        """Hold (or join to its rank group) the milestone of ``rule``'s match on a line of ``proc``."""
        if self.world_size is None:
            ws = fields.get("world_size")
            if isinstance(ws, int) and ws > 0:
                self.world_size = ws
        ms = self._milestone(rule, fields, text, line, rank)
        self._completed = self._completed or ms.kind == "completed"
        if rule.per_rank:
            self._held += self._rank_groups.join(rule.name, ms, proc, rank, self.world_size)
        else:
            self._held.append(ms)

    def _milestone(
        self, rule: Rule, fields: dict[str, Any], text: str, line: int, rank: int | None
    ) -> Milestone:
        """``rule``'s milestone; an engine exit after the completion marker is normal_shutdown."""
        if self._completed and rule.name in SHUTDOWN_RULES:
            kept = {k: v for k, v in fields.items() if k not in ("class", "severity")}
            fields = kept | {"severity": "info", "shutdown_of": fields.get("rule")}
            return Milestone("normal_shutdown", line, rank, fields, text)
        return Milestone(rule.kind, line, rank, fields, text)

    # ---- tracebacks ----------------------------------------------------------------------------------
    def _close_trace(self, proc: str) -> None:
        tr = self._traces.pop(proc)
        extra, text = tracebacks.summary(tr)
        self._exception(Milestone("error", tr.line, tr.rank, extra, text), tr.excs, tr.proc)

    def _exception(self, base: Milestone, excs: Sequence[Sequence[str]], proc: str) -> None:
        """Hold the ``error`` of exceptions ``excs`` ([type, message, (line text)]), classified root first."""
        fields: dict[str, Any] = {"rule": "traceback", "class": "traceback", "severity": "error"}
        decided = excs[-1] if excs else None
        for exc in excs:
            for rule in self._error_rules:
                m = rule.regex.search(f"{exc[0]}: {exc[1]}" if exc[1] else exc[0])
                if m is not None:
                    fields, decided = self._fields(rule, m), exc
                    break
            else:
                continue
            break
        if decided is not None:
            fields["exc_type"], fields["message"] = decided[0], decided[1]
        else:
            fields["exc_type"], fields["message"] = None, "traceback ended without an exception line"
        fields.update(base.fields)
        text = decided[2] if decided is not None and len(decided) > 2 else base.text
        ms = Milestone("error", base.line, base.rank, fields, text)
        if base.rank is not None:
            key = f"traceback:{fields['class']}:{fields['exc_type']}"
            self._held += self._rank_groups.join(key, ms, proc, base.rank, self.world_size)
        else:
            self._held.append(ms)

    # ---- release in line order ----------------------------------------------------------------------
    def _expire(self, line: int) -> None:
        if self._groups:
            self._held += self._rank_groups.expire(line, self.window, self.world_size)
        for proc in [p for p, t in self._traces.items() if line - t.last_line > self.window]:
            self._close_trace(proc)

    def _release(self) -> list[Milestone]:
        if not self._held:
            return []
        opens = [g.first.line for g in self._groups.values()] + [t.line for t in self._traces.values()]
        if not opens:
            out = self._held if len(self._held) == 1 else sorted(self._held, key=lambda m: m.line)
            self._held = []
            return _tagged(out)
        limit = min(opens)
        self._held.sort(key=lambda m: m.line)
        n = 0
        while n < len(self._held) and self._held[n].line < limit:
            n += 1
        out, self._held = self._held[:n], self._held[n:]
        return _tagged(out)
