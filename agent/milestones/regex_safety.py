"""Pure: the limits a run spec's own rule regexes are held to (they run inside the daemon, beside every run).

docs/milestones.md says which shapes are refused and why; such rules also search only the first
``MAX_USER_TEXT`` characters of a message, which bounds what polynomial backtracking is left.
"""

from __future__ import annotations

import itertools
import re
import re._constants as sre_c
import re._parser as sre_parse
from collections.abc import Callable
from typing import Any

MAX_USER_REGEX = 300
MAX_USER_TEXT = 400
_REPEATS = (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT)


def _repeats_or_branches(items: Any) -> str | None:
    """What inside a quantified part makes backtracking explode: a quantifier or an alternation."""
    for op, av in items:
        if op in _REPEATS and av[1] > 1:
            return "a quantifier"
        if op is sre_c.BRANCH:
            return "an alternation"
        if found := _walk(op, av, _repeats_or_branches):
            return found
    return None


def _walk(op: Any, av: Any, fn: Callable[[Any], str | None]) -> str | None:
    """Apply ``fn`` to the sub-patterns of one parsed node."""
    if op is sre_c.SUBPATTERN:
        return fn(av[3])
    if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
        return fn(av[1])
    if op is sre_c.BRANCH:
        for alt in av[1]:
            if found := fn(alt):
                return found
    if op in _REPEATS or op is sre_c.POSSESSIVE_REPEAT:
        return fn(av[2])
    if op is sre_c.ATOMIC_GROUP:
        return fn(av)
    if op is sre_c.GROUPREF_EXISTS:
        return fn(av[1]) or (fn(av[2]) if av[2] is not None else None)
    return None


_CATEGORY_CHARS = {
    sre_c.CATEGORY_DIGIT: frozenset("0123456789"),
    sre_c.CATEGORY_SPACE: frozenset(" \t\n\r\f\v"),
    sre_c.CATEGORY_WORD: frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"),
}


def _chars(body: Any) -> frozenset[str] | None:
    """The characters a one-item repeat body can match; None for "any, as far as this check knows"."""
    items = list(body)
    if len(items) != 1:
        return None
    op, av = items[0]
    if op is sre_c.LITERAL:
        return frozenset(chr(av))
    if op is not sre_c.IN:
        return None
    out: set[str] = set()
    for iop, iav in av:
        if iop is sre_c.LITERAL:
            out.add(chr(iav))
        elif iop is sre_c.RANGE and iav[1] - iav[0] <= 256:
            out.update(chr(c) for c in range(iav[0], iav[1] + 1))
        elif iop is sre_c.CATEGORY and iav in _CATEGORY_CHARS:
            out |= _CATEGORY_CHARS[iav]
        else:  # negated sets, other categories, wide ranges
            return None
    return frozenset(out)


def _edge(item: Any, last: bool) -> tuple[frozenset[str] | None] | None:
    """The class of the quantifier at the start (or end) of ``item``; None when it has none there."""
    op, av = item
    if op in _REPEATS and av[1] > 1:
        return (_chars(av[2]),)
    if op is sre_c.SUBPATTERN and list(av[3]):
        inner = list(av[3])
        return _edge(inner[-1] if last else inner[0], last)
    return None


def _adjacent(items: Any) -> str | None:
    items = list(items)
    for a, b in itertools.pairwise(items):
        tail, head = _edge(a, last=True), _edge(b, last=False)
        if tail is None or head is None:
            continue
        if tail[0] is None or head[0] is None or tail[0] & head[0]:
            return (
                "two quantifiers in a row match the same characters (polynomial backtracking, like \\d+\\d+)"
            )
    for op, av in items:
        if found := _walk(op, av, _adjacent):
            return found
    return None


def _nested(items: Any) -> str | None:
    for op, av in items:
        if op in _REPEATS and av[1] > 1 and (inner := _repeats_or_branches(av[2])):
            return f"a quantified group holds {inner} (catastrophic backtracking, like (a+)+ or (a|a)*)"
        if found := _walk(op, av, _nested):
            return found
    return None


def check_user_regex(pattern: str) -> str | None:
    """Why a user-supplied regex could stall the daemon, or None when its shape is safe enough."""
    if len(pattern) > MAX_USER_REGEX:
        return f"is {len(pattern)} characters long; user rules allow at most {MAX_USER_REGEX}"
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        return f"does not compile: {exc}"
    return _nested(list(parsed)) or _adjacent(list(parsed))
