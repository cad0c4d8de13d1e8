"""Pure: what the milestone engine remembers per line shape, so that a known shape costs one regex match.

A line's shape is its bytes with ASCII digits folded to ``0`` (``agent/logs/splitter.DIGIT_FOLD``).  A shape's
``ShapePlan`` holds where the line's parts lie (``logline.LineLayout``) and the rule that matched its first
line.  A rule that treats all ASCII digits alike (``digit_uniform``) matches every line of the shape exactly
where it matched the first, with the same spans, so its groups are taken there and no regex runs; any other
rule is verified by one match per line, the engine's full path taking over when it fails.  A plan is only
made when every candidate rule before the remembered one is digit-uniform (such a rule cannot match a line
of a shape on which it failed); a shape that needs more (a traceback, an ERROR record, a line answered line
by line) gets none.
"""

from __future__ import annotations

import functools
import re
import re._constants as sre_c
import re._parser as sre_parse
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from agent.milestones.logline import LineLayout
from agent.milestones.rulefile import Rule, convert

#: At most this many shapes remembered (lines of free text never repeat their shape).
MAX_PLANS = 1 << 14

_DIGITS = range(ord("0"), ord("9") + 1)
_CHAR_OPS = (sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.LITERAL_IGNORE, sre_c.NOT_LITERAL_IGNORE)
_RANGE_OPS = (sre_c.RANGE, sre_c.RANGE_UNI_IGNORE)
_REF_OPS = (sre_c.GROUPREF, sre_c.GROUPREF_IGNORE, sre_c.GROUPREF_LOC_IGNORE, sre_c.GROUPREF_UNI_IGNORE)


def _uniform(node: Any) -> bool:
    """Whether a parsed regex node (or a list of them) treats every ASCII digit alike."""
    if isinstance(node, sre_parse.SubPattern):
        return all(_uniform(item) for item in node.data)
    if isinstance(node, tuple) and len(node) == 2 and isinstance(node[0], sre_c._NamedIntConstant):
        op, av = node
        if op in _CHAR_OPS:
            return av not in _DIGITS
        if op in _RANGE_OPS:
            lo, hi = av
            return (
                hi < _DIGITS.start or lo >= _DIGITS.stop or (lo <= _DIGITS.start and hi >= _DIGITS.stop - 1)
            )
        if op in _REF_OPS:  # a back-reference compares digits with digits
            return False
        return _uniform(av)
    if isinstance(node, (list, tuple)):
        return all(_uniform(item) for item in node)
    return node is None or isinstance(node, int)  # group numbers, repeat counts, flags


def digit_uniform(regex: re.Pattern[str]) -> bool:
    """Whether ``regex`` treats all ASCII digits alike: then it matches a line exactly where it matches the
    line with its digits folded to ``0``, with the same spans (False when unsure)."""
    return _pattern_uniform(regex.pattern, regex.flags)


@functools.lru_cache(maxsize=1024)  # every engine of a daemon asks about the same built-in rules
def _pattern_uniform(pattern: str, flags: int) -> bool:
    try:
        return _uniform(sre_parse.parse(pattern, flags))
    except (re.error, TypeError, ValueError, RecursionError):
        return False


#: Spans of a regex's groups by group number (``Match.regs``; (-1, -1): the group did not match).
Regs = Sequence[tuple[int, int]]
#: Builds a rule's fields from a string and the spans of its regex's groups in it (``m.string, m.regs``).
FieldsBuilder = Callable[[str, Regs], dict[str, Any]]


#: Kinds whose converter starts with a plain ``int()``/``float()`` (rulefile._to_int/_to_float): that call
#: alone decides a well-formed value; anything else goes through ``convert``.
_PLAIN = {"int": int, "float": float, "percent": float, "seconds": float}


def fields_builder(rule: Rule, spans: Regs | None = None) -> FieldsBuilder:
    """A function from a match of ``rule`` to its milestone fields, as ``convert`` makes them: ``rule``, the
    named groups that matched (converted as ``rule.fields`` says; a value that does not convert stays a
    string), ``rule.set``, then ``class`` and ``severity`` — looked up once per rule, not per line.  With
    ``spans`` (a shape's, of a digit-uniform rule) it ignores the spans it is given and loops only over the
    groups that match in that shape."""
    groups: list[tuple[str, int, str | None, Callable[[str], Any] | None]] = []
    for name, index in rule.regex.groupindex.items():
        kind = rule.fields.get(name, "str")
        if spans is None or spans[index][0] >= 0:
            groups.append((name, index, None if kind == "str" else kind, _PLAIN.get(kind)))
    tail: dict[str, Any] = dict(rule.set)
    if rule.error_class:
        tail["class"] = rule.error_class
    if rule.kind in ("error", "warning"):
        tail["severity"] = rule.severity
    name = rule.name

    def build(text: str, regs: Regs) -> dict[str, Any]:
        fields: dict[str, Any] = {"rule": name}
        if spans is not None:
            regs = spans
        for key, index, kind, plain in groups:
            start, end = regs[index]
            if start < 0:
                continue
            value = text[start:end]
            if kind is None:
                fields[key] = value
                continue
            if plain is not None:
                try:
                    number = plain(value)
                    if number - number == 0:  # finite (inf - inf and nan are nan): what _to_float allows
                        fields[key] = number
                        continue
                except ValueError:
                    pass
            fields[key] = convert(kind, value)
        if tail:
            fields.update(tail)
        return fields

    return build


def _no_fields(_text: str, _regs: Regs) -> dict[str, Any]:
    return {}


class ShapePlan(NamedTuple):
    """How to classify a line of a known shape: its rule (None: no rule matches a line of this shape), the
    rule's fields builder, where the line's parts lie, and for a digit-uniform rule the spans of its groups in
    the line (None: verify the rule by a match on each line)."""

    rule: Rule | None
    build: FieldsBuilder
    layout: LineLayout
    regs: list[tuple[int, int]] | None = None  # in the line (``Match.regs`` of the message, shifted)
    rank: tuple[int, int] | None = None  # ``layout.rank``
    json: int = 0  # a marker rule's group "json" (its number)


class ShapePlans:
    """The plans of the shapes seen so far (bounded), with each rule's fields builder."""

    def __init__(self) -> None:
        self.plans: dict[bytes, ShapePlan | None] = {}  # None: the shape takes the full path
        self._builders: dict[int, tuple[Rule, FieldsBuilder]] = {}

    def builder(self, rule: Rule) -> FieldsBuilder:
        """``fields_builder(rule)``, built once per rule."""
        known = self._builders.get(id(rule))
        if known is None or known[0] is not rule:
            known = self._builders[id(rule)] = (rule, fields_builder(rule))
        return known[1]

    def learn(
        self,
        key: bytes,
        layout: LineLayout | None,
        candidates: Sequence[Rule],
        matched: int | None,
        m: re.Match[str] | None,
    ) -> ShapePlan | None:
        """Remember the plan of shape ``key`` whose first line matched ``candidates[matched]`` with ``m``
        (searched in the line's message; None: no candidate matched); no plan (None) when ``layout`` is
        None (the line needs the full path) or a later line of the shape might match an earlier candidate
        (one that names digits)."""
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        before = candidates if matched is None else candidates[:matched]
        plan = None
        if layout is not None and all(digit_uniform(rule.regex) for rule in before):
            if matched is None or m is None:
                plan = ShapePlan(None, _no_fields, layout)
            else:
                rule = candidates[matched]
                regs = None
                if digit_uniform(rule.regex):  # the match's spans hold for every line of the shape
                    at = layout.message
                    regs = [(a + at, b + at) if a >= 0 else (-1, -1) for a, b in m.regs]
                json = rule.regex.groupindex.get("json", 0)
                build = self.builder(rule) if regs is None or rule.marker else fields_builder(rule, regs)
                plan = ShapePlan(rule, build, layout, regs, layout.rank, json)
        self.plans[key] = plan
        return plan
