"""Anatomy of a vLLM log line (process prefix, rank, header, message) and the rules' cheap prefilter."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import compress
from typing import NamedTuple

from agent.logs.splitter import DIGIT_FOLD
from agent.milestones.rulefile import Rule, RuleSet

# "(Worker_TP3 pid=7) ", "(VllmWorker rank=3 pid=7) ", Ray's "(RayWorkerWrapper pid=7, ip=10.0.0.2) "
_PREFIX_RE = re.compile(
    r"\((?P<proc>[A-Za-z][\w.-]*)(?: rank=(?P<rank>\d+))? pid=(?P<pid>\d+)(?:, ip=[^)\s]*)?\) "
)
_HEADER_RE = re.compile(
    r"(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? "
    r"\[?(?P<src>[^\s\]]+:\d+)\] ?"
)
_TP_RE = re.compile(r"_TP(\d+)|-(\d+)$")
# The tag the speculators job (agent/extract/pipelines/run.py) writes before each line of its two processes.
_TAG_RE = re.compile(r"\[(?P<tag>server|client)\] ")


def process_tag(text: str) -> str | None:
    """``server`` / ``client`` for a line of a two-process job, else None."""
    m = _TAG_RE.match(text)
    return m.group("tag") if m else None


class ParsedLine(NamedTuple):
    """A log line cut into process prefix, rank, level, source and message (a tuple: made for every line
    that may match a rule, so cheap to build)."""

    proc: str  # "Worker_TP3 pid=7", "" without a prefix; "[server] Worker_TP3 pid=7" behind a process tag
    rank: int | None
    level: str | None
    source: str | None
    message: str


def parse_line(text: str) -> ParsedLine:
    """Split a (stripped) vLLM log line into prefix, header and message."""
    proc, rank, pos = "", None, 0
    tag = _TAG_RE.match(text)
    if tag:
        pos = tag.end()
    m = _PREFIX_RE.match(text, pos)
    if m:
        name = m.group("proc")
        proc = f"{name} pid={m.group('pid')}"
        if m.group("rank"):
            rank = int(m.group("rank"))
        else:
            t = _TP_RE.search(name)
            if t:
                rank = int(t.group(1) or t.group(2))
        pos = m.end()
    if tag:  # the server's and the client's tracebacks and rank groups stay apart
        proc = f"[{tag.group('tag')}] {proc}".rstrip()
    h = _HEADER_RE.match(text, pos)
    if h:
        return ParsedLine(proc, rank, h.group("level"), h.group("src"), text[h.end() :])
    return ParsedLine(proc, rank, None, None, text[pos:])


class LineLayout(NamedTuple):
    """Where ``parse_line``'s parts lie in a line, as (start, end) spans: the same for every line of one
    shape (digits folded to ``0``), since the prefix and header patterns treat all digits alike
    (tests/agent/test_shape_plans.py checks both)."""

    tag: str | None  # "server" / "client"
    name: tuple[int, int] | None  # the process name of the prefix; None without a prefix
    pid: tuple[int, int]
    rank: tuple[int, int] | None
    level: str | None
    message: int  # where the message starts

    def proc(self, text: str) -> str:
        """``ParsedLine.proc`` of a line of this layout."""
        proc = ""
        if self.name is not None:
            proc = f"{text[self.name[0] : self.name[1]]} pid={text[self.pid[0] : self.pid[1]]}"
        return f"[{self.tag}] {proc}".rstrip() if self.tag is not None else proc


def line_layout(text: str) -> LineLayout:
    """``parse_line``'s cuts of ``text`` as spans (tests/agent/test_shape_plans.py holds them equal)."""
    name = rank = None
    pid = (0, 0)
    pos = 0
    tag = _TAG_RE.match(text)
    if tag:
        pos = tag.end()
    m = _PREFIX_RE.match(text, pos)
    if m:
        name, pid = m.span("proc"), m.span("pid")
        if m.group("rank"):
            rank = m.span("rank")
        else:
            t = _TP_RE.search(m.group("proc"))
            if t:
                g = 1 if t.group(1) else 2
                rank = (name[0] + t.start(g), name[0] + t.end(g))
        pos = m.end()
    h = _HEADER_RE.match(text, pos)
    level = h.group("level") if h else None
    return LineLayout(tag.group("tag") if tag else None, name, pid, rank, level, h.end() if h else pos)


def _anchor(literal: str) -> str | None:
    """The longest whitespace-delimited word that every line containing ``literal`` must also contain."""
    words = literal.split()
    whole = [
        w
        for i, w in enumerate(words)
        if (i > 0 or literal[:1].isspace()) and (i < len(words) - 1 or literal[-1:].isspace())
    ]
    return max(whole, key=len) if whole else None


class Gate:
    """Cheap prefilter: one split into words and a set test per line, plus a few plain substring tests.

    A rule's ``words`` are looked up directly; each ``contains`` literal is reduced to an anchor word (a
    word of the literal bounded by whitespace inside it, so any line holding the literal holds that word
    whole) and confirmed with ``in``; literals without one are tested with ``in`` on every line.
    """

    def __init__(self, rules: RuleSet, always_literals: Sequence[str] = ()) -> None:
        self.by_word: dict[str, list[tuple[int, str | None]]] = {}
        self.by_literal: dict[str, list[int]] = {}
        self.always: list[int] = []
        self.rules = rules.rules
        for i, rule in enumerate(rules.rules):
            if not rule.contains and not rule.words:
                self.always.append(i)
            for word in rule.words:
                self.by_word.setdefault(word, []).append((i, None))
            for lit in rule.contains:
                anchor = _anchor(lit)
                if anchor is None:
                    self.by_literal.setdefault(lit, []).append(i)
                else:
                    self.by_word.setdefault(anchor, []).append((i, lit))
        for lit in always_literals:
            always = _anchor(lit)
            if always is None:
                raise ValueError(f"gate literal {lit!r} needs a whitespace-bounded word")
            self.by_word.setdefault(always, [])
        self.words = frozenset(self.by_word)
        self.literals = tuple(self.by_literal)

    def passes(self, text: str) -> bool:
        """Whether ``text`` may match some rule (no false negatives)."""
        if self.always or not self.words.isdisjoint(text.split()):
            return True
        return any(lit in text for lit in self.literals)

    def candidates(self, text: str) -> list[Rule]:
        """The rules whose prefilter ``text`` passes, in rule order."""
        idx = set(self.always)
        for word in self.words.intersection(text.split()):
            for i, lit in self.by_word[word]:
                if lit is None or lit in text:
                    idx.add(i)
        for lit, rules in self.by_literal.items():
            if lit in text:
                idx.update(rules)
        return [self.rules[i] for i in sorted(idx)]


#: Timestamps, pids, counters: digits make nearly every log line unique, and no gate word holds one.
MEMO_MAX = 1 << 16
_UNKNOWN: list[Rule] = []  # not looked at yet
_PER_LINE: list[Rule] = []  # answered line by line (a literal with a digit decides)


class Prefilter:
    """Which lines of a batch may pass the gate, from the gate's remembered answer per line shape.

    A line's shape (its memo key) is its UTF-8 bytes with every ASCII digit folded to ``0``
    (``DIGIT_FOLD``).  Sound (never rejects a line the gate passes) while no gate word or literal holds an
    ASCII digit: folding digits leaves every other byte where it was, so a gate word that is a whole word of
    the line stays one and a literal stays a substring; it may make a new one (a false positive, which the
    gate then rejects).  ``usable`` is False otherwise, and for a rule set with a rule that has no prefilter.
    The shapes are made for a whole batch at once in C (``bytes.translate`` and one split; an ASCII digit
    byte never occurs inside a multi-byte UTF-8 character, so a shape decodes to its line, digits folded)
    and looked up with ``map``/``compress``: no Python code runs per line that is skipped.
    """

    def __init__(self, gate: Gate, keep: Callable[[str], bool] | None = None) -> None:
        self.gate = gate
        #: whether a line the gate passes but no rule can match still matters (a traceback's first line)
        self.keep = keep or (lambda _text: True)
        self.usable = not gate.always and not any(
            ch in "0123456789" for w in (*gate.words, *gate.literals) for ch in w
        )
        self.memo: set[bytes] = set()  # the shapes answered so far
        self._hit: set[bytes] = set()  # those of them that may pass the gate
        self._rules: dict[bytes, list[Rule] | None] = {}
        self._digit_anchors = frozenset(
            word
            for word, entries in gate.by_word.items()
            if any(lit is not None and any(ch.isdigit() for ch in lit) for _, lit in entries)
        )

    def rules_for(self, text: str) -> list[Rule] | None:
        """``gate.candidates(text)``, or None when the gate rejects ``text`` or no rule can match it and
        ``keep`` says it does not matter otherwise; remembered per line shape.

        Exact, not only sound: a gate word or literal holds no digit, so it is a word or substring of the
        shape exactly where it is one of the line (callers check ``usable`` first; ``keep`` must give the
        same answer for a line and its shape).  A ``contains`` literal that holds a digit is confirmed on
        each line: shapes holding its anchor word are answered line by line.
        """
        key = self.key(text)
        rules = self._rules.get(key, _UNKNOWN)
        if rules is _UNKNOWN:
            if len(self._rules) >= MEMO_MAX:
                self._rules.clear()
            per_line = bool(self._digit_anchors) and not self._digit_anchors.isdisjoint(text.split())
            rules = self._rules[key] = _PER_LINE if per_line else self._decide(text)
        return self._decide(text) if rules is _PER_LINE else rules

    def _decide(self, text: str) -> list[Rule] | None:
        rules = self.gate.candidates(text) if self.gate.passes(text) else None
        return None if rules is not None and not rules and not self.keep(text) else rules

    def key(self, text: str) -> bytes:
        """The memo key of a line: its shape (UTF-8 bytes, ASCII digits folded to ``0``)."""
        return text.encode("utf-8", "surrogatepass").translate(DIGIT_FOLD)

    def per_line(self, key: bytes) -> bool:
        """Whether the lines of shape ``key`` are answered line by line (a literal with a digit decides)."""
        return self._rules.get(key) is _PER_LINE

    def keys(self, texts: Sequence[str]) -> list[bytes]:
        """The shapes of ``texts`` (one encode, fold and split in C for the whole batch)."""
        keys = "\n".join(texts).encode("utf-8", "surrogatepass").translate(DIGIT_FOLD).split(b"\n")
        if len(keys) != len(texts):  # a text holding "\n" (the splitter never makes one): key by key
            keys = [self.key(t) for t in texts]
        return keys

    def hits_of(self, keys: list[bytes]) -> list[int]:
        """Indices (ascending) of the lines whose shapes are ``keys`` that may pass the gate."""
        memo, hit = self.memo, self._hit
        if not memo.issuperset(keys):  # shapes not seen yet (or forgotten): answer each once
            new = set(keys).difference(memo)
            if len(memo) + len(new) > MEMO_MAX:  # bounded: lines of free text (prompts, paths) never repeat
                memo.clear()
                hit.clear()
                new = set(keys)
            rules_for = self.rules_for
            for k in new:
                text = k.decode("utf-8", "surrogatepass")  # a shape's answers are its lines' answers
                # a JSON log record is read as the text lines it stands for: the gate sees those, not this
                # (a shape answered line by line is a hit: its lines are confirmed one by one)
                if text[:1] == "{" or rules_for(text) is not None or self._rules.get(k) is _PER_LINE:
                    hit.add(k)
                memo.add(k)
        # a shape's hash is kept in its bytes object: the second look-up per line costs no hashing
        return list(compress(range(len(keys)), map(hit.__contains__, keys)))
