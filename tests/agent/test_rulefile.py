"""Rule data: loading, extending and overriding rules, typed errors for bad rule files, field conversions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.milestones.engine import MilestoneEngine, load_rules
from agent.milestones.logline import Gate
from agent.milestones.rulefile import BUILTIN_DIR, BUILTIN_FILES, RuleError, convert, read_rule_file

GOOD = {
    "name": "mine",
    "kind": "progress",
    "contains": "step ",
    "regex": r"step (?P<n>\d+)",
    "fields": {"n": "int"},
}


def first(rules: Any, line: str) -> Any:
    """The milestones of one line, flushed."""
    eng = MilestoneEngine(rules)
    return eng.feed(line, 1) + eng.flush()


def test_builtin_files_load_and_every_name_is_unique() -> None:
    """The shipped TOML files validate; names do not collide across files."""
    names: list[str] = []
    for name in BUILTIN_FILES:
        names += [r.name for r in read_rule_file(BUILTIN_DIR / name)]
    assert len(names) == len(set(names))
    assert [r.name for r in load_rules().rules] == names


def test_spec_rules_extend_the_builtins() -> None:
    """A run spec's rules (dicts) are appended and match."""
    rules = load_rules(extra=[GOOD])
    (m,) = first(rules, "training step 42 done")
    assert (m.kind, m.fields["n"], m.fields["rule"]) == ("progress", 42, "mine")


def test_rule_file_extends_and_overrides_by_name(tmp_path: Path) -> None:
    """A --rules file adds rules, replaces a built-in of the same name and can disable one."""
    f = tmp_path / "extra.toml"
    f.write_text(
        """
[[rule]]
name = "killed"
kind = "error"
class = "killed"
words = "OOMKILL"
regex = 'OOMKILL (?P<victim>\\S+)'

[[rule]]
name = "throughput"
kind = "throughput"
regex = 'x'
enabled = false

[[rule]]
name = "epoch"
kind = "progress"
contains = "epoch "
regex = 'epoch (?P<epoch>\\d+)/(?P<epochs>\\d+)'
fields = { epoch = "int", epochs = "int" }
set = { phase = "train" }
"""
    )
    rules = load_rules(files=[f])
    names = [r.name for r in rules.rules]
    assert "throughput" not in names
    assert names.index("killed") < names.index("epoch")
    (m,) = first(rules, "OOMKILL python3")
    assert m.fields["victim"] == "python3"
    assert first(rules, "Killed") == []
    (m,) = first(rules, "epoch 3/10")
    assert m.fields == {"rule": "epoch", "epoch": 3, "epochs": 10, "phase": "train"}
    assert first(rules, "Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 1.0 tokens/s") == []


def test_json_rule_file(tmp_path: Path) -> None:
    """A .json rule file works like TOML."""
    f = tmp_path / "r.json"
    f.write_text('{"rule": [{"name": "j", "kind": "warning", "words": "WARNME", "regex": "WARNME"}]}')
    (m,) = first(load_rules(files=[f]), "x WARNME y")
    assert (m.kind, m.fields["severity"]) == ("warning", "warning")


def test_rule_without_prefilter_runs_on_every_line() -> None:
    """No contains and no words: the regex is tried on every line (slower, still correct)."""
    rules = load_rules(extra=[{"name": "any", "kind": "warning", "regex": r"^zz(?P<n>\d)"}])
    (m,) = first(rules, "zz7")
    assert m.fields["n"] == "7"


@pytest.mark.parametrize(
    ("rule", "field", "message"),
    [
        ({**GOOD, "kind": "bogus"}, "kind", "unknown milestone kind 'bogus'"),
        ({k: v for k, v in GOOD.items() if k != "regex"}, "regex", "missing"),
        ({**GOOD, "regex": "(unclosed"}, "regex", "does not compile"),
        ({**GOOD, "fields": {"n": "liters"}}, "fields", "unknown conversion 'liters'"),
        ({**GOOD, "fields": {"m": "int"}}, "fields", "not a named group"),
        ({**GOOD, "kind": "error"}, "class", "needs a class"),
        ({**GOOD, "kind": "error", "class": "gremlins"}, "class", "needs a class"),
        ({**GOOD, "class": "oom"}, "class", "only rules of kind 'error'"),
        ({**GOOD, "severity": "meh"}, "severity", "must be one of"),
        ({**GOOD, "per_rank": "yes"}, "per_rank", "true or false"),
        ({**GOOD, "contains": ""}, "contains", "non-empty"),
        ({**GOOD, "words": "two words"}, "words", "no whitespace"),
        ({**GOOD, "colour": "red"}, "colour", "unknown key"),
        ({**GOOD, "name": "has space"}, "name", "must be 1-80"),
        ({**GOOD, "marker": True}, "regex", "named group 'json'"),
        ({**GOOD, "set": ["x"]}, "set", "table"),
    ],
)
def test_bad_spec_rule_names_source_index_and_field(rule: dict[str, Any], field: str, message: str) -> None:
    """A bad rule is a RuleError naming where (spec.rules, #index) and which field."""
    with pytest.raises(RuleError) as info:
        load_rules(extra=[GOOD, rule])
    err = info.value
    assert message in str(err)
    name = f" {rule['name']!r}" if isinstance(rule.get("name"), str) else ""
    assert str(err).startswith(f"spec.rules: rule[1]{name}: field '{field}': ")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[[rule]\nname = 'x'", "not valid toml"),
        ("rules = []", "unknown top-level key"),
        ("rule = 5", "expected a list of rules"),
        (
            "[[rule]]\nname = 'a'\nkind = 'progress'\nregex = 'a'\n[[rule]]\nname = 'a'\nkind = "
            "'progress'\nregex = 'b'",
            "duplicate rule name 'a'",
        ),
        ("[[rule]]\nname = 'a'\nkind = 'progress'\nregex = '('", "does not compile"),
    ],
)
def test_bad_rule_file_names_the_file(tmp_path: Path, content: str, message: str) -> None:
    """Syntax errors, wrong shapes and bad rules name the file."""
    f = tmp_path / "bad.toml"
    f.write_text(content)
    with pytest.raises(RuleError) as info:
        load_rules(files=[f])
    assert str(f) in str(info.value)
    assert message in str(info.value)


def test_missing_rule_file(tmp_path: Path) -> None:
    """A rule file that does not exist is a RuleError naming it."""
    with pytest.raises(RuleError, match="cannot read"):
        load_rules(files=[tmp_path / "nope.toml"])


def test_bad_utf8_rule_file(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are reported, not raised as UnicodeDecodeError."""
    f = tmp_path / "bin.toml"
    f.write_bytes(b"\xff\xfe[[rule]]")
    with pytest.raises(RuleError, match="not valid"):
        load_rules(files=[f])


@pytest.mark.parametrize(
    ("conv", "raw", "value"),
    [
        ("int", "262,144", 262144),
        ("int", "1_000", 1000),
        ("int", "12.0", 12),
        ("float", "64.00", 64.0),
        ("gib", "7.5", 7.5),
        ("gib", "7.5 GiB", 7.5),
        ("gib", "512 MiB", 0.5),
        ("gib", "0.52GiB", 0.52),
        ("percent", "37.5%", 37.5),
        ("seconds", "12 secs", 12.0),
        ("seconds", "1.5s", 1.5),
        ("list", "['a', 'b']", ["a", "b"]),
        ("list", '["a"]', ["a"]),
        ("str", " x ", " x "),
        # unconvertible values stay as text: a log line never breaks ingestion
        ("int", "N/A", "N/A"),
        ("list", "{1, 2}", "{1, 2}"),
        ("list", "[b'x']", "[b'x']"),
        ("float", "", ""),
        ("float", "nan", "nan"),
        ("seconds", "inf s", "inf s"),
        ("int", " 42 ", 42),
        ("clock", "00:02", 2),
        ("clock", "01:02:03", 3723),
        ("clock", "2", "2"),
        ("clock", "?", "?"),
    ],
)
def test_conversions(conv: str, raw: str, value: Any) -> None:
    """Field conversions, including thousands separators and units."""
    assert convert(conv, raw) == value


@pytest.mark.parametrize(
    "wrap", [("", ""), ("xx", "yy"), ("(Worker_TP1 pid=2) INFO 02-21 22:48:03 [a.py:1] ", "\t!")]
)
def test_gate_has_no_false_negatives(wrap: tuple[str, str]) -> None:
    """Any line holding a rule's literal (glued to other text or not) passes the gate and names that rule."""
    rules = load_rules()
    gate = Gate(rules, ("Traceback (most recent call last)",))
    for rule in rules.rules:
        for lit in rule.contains:
            text = wrap[0] + lit + wrap[1]
            assert gate.passes(text), (rule.name, lit)
            assert rule in gate.candidates(text), (rule.name, lit)
        for word in rule.words:
            text = f"{wrap[0]} {word} {wrap[1]}"
            assert gate.passes(text) and rule in gate.candidates(text), (rule.name, word)
    assert gate.passes("xxTraceback (most recent call last):")
    assert not gate.passes("Captured hidden states for batch 4: 4096 tokens")


@pytest.mark.parametrize(
    ("backend", "pipeline_rules"),
    [("worker-extension", False), ("vllm-native", False), ("speculators", True), ("specforge", True),
     ("command", True), (None, True)],
)  # fmt: skip
def test_pipeline_rules_load_only_where_their_lines_can_appear(
    backend: str | None, pipeline_rules: bool
) -> None:
    names = {r.name for r in load_rules(backend=backend).rules}
    assert ("speculators_client_start" in names) is pipeline_rules
    assert ("specforge_capture_plan" in names) is pipeline_rules
    assert "graph_capture" in names  # vLLM's own rules always
