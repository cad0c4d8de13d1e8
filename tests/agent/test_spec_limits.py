"""Bounds and strict types of the run spec (agent/spec.py, agent/limits.py); a real daemon takes them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agent import limits
from agent.protocol import MAX_LINE_BYTES, decode_request, encode
from agent.runs.jobspec import JobSpec
from agent.spec import parse_spec
from tests.helpers.agentproc import AgentClient, AgentError, AgentProc, agent_daemon

__all__ = ["agent_daemon"]

CMD: dict[str, Any] = {"host": "h1", "backend": "command", "command": ["true"]}
EXTRACT: dict[str, Any] = {"host": "h1", "model": "/m", "dataset": "/d.jsonl", "output_dir": "/o"}


def _refused(spec: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.raises(ValidationError) as err:
        parse_spec(spec)
    return list(err.value.errors())


def _fields(errors: list[dict[str, Any]]) -> list[str]:
    return [".".join(str(p) for p in e["loc"]) for e in errors]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tensor_parallel_size": "8"}, "tensor_parallel_size"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 8.0}, "tensor_parallel_size"),
        ({"max_samples": "100"}, "max_samples"),
        ({"seq_len": True}, "seq_len"),
        ({"batch_size": "8"}, "batch_size"),
        ({"layers": [2, True]}, "layers.1"),
        ({"layers": ["2"]}, "layers.0"),
        ({"expect": {"layers": "4"}}, "expect.layers"),
        ({"expect": {"hidden_size": True}}, "expect.hidden_size"),
    ],
)
def test_numbers_are_strict_integers(change: dict[str, Any], field: str) -> None:
    assert field in _fields(_refused({**EXTRACT, **change}))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layers": [2**63]}, "layers"),
        ({"layers": [2, limits.MAX_LAYER_ID + 1]}, "layers"),
        ({"max_samples": 2**64}, "max_samples"),
        ({"tensor_parallel_size": 2**63}, "tensor_parallel_size"),
        ({"expect": {"layers": 2**63}}, "expect.layers"),
        ({"expect": {"hidden_size": 2**40}}, "expect.hidden_size"),
        ({"seq_len": 2**31}, "seq_len"),
    ],
)
def test_integers_have_upper_bounds(change: dict[str, Any], field: str) -> None:
    assert field in _fields(_refused({**EXTRACT, **change}))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"env": {"A": "x" * 50_000_000}}, "env.A"),
        ({"env": {"A": "x" * (limits.MAX_ENV_VALUE_CHARS + 1)}}, "env.A"),
        ({"env": {f"V{i}": "1" for i in range(limits.MAX_ENV_VARS + 1)}}, "env"),
        ({"env": {"A" * (limits.MAX_ENV_NAME_CHARS + 1): "1"}}, "env"),
        ({"vllm_args": ["--x"] * 1_000_000}, "vllm_args"),
        ({"vllm_args": ["x" * (limits.MAX_ARG_CHARS + 1)]}, "vllm_args.0"),
        ({"model": "/" + "m" * limits.MAX_PATH_CHARS}, "model"),
        ({"output_dir": "/" + "o" * limits.MAX_PATH_CHARS}, "output_dir"),
        ({"layers": list(range(limits.MAX_LAYERS + 1))}, "layers"),
        ({"rules": [{"kind": "warning"}] * (limits.MAX_RULES + 1)}, "rules"),
    ],
)
def test_every_field_is_bounded(change: dict[str, Any], field: str) -> None:
    started = time.monotonic()
    fields = _fields(_refused({**EXTRACT, **change}))
    assert any(f == field or f.startswith(field + ".") for f in fields), fields
    assert time.monotonic() - started < 5


def test_command_items_are_bounded() -> None:
    assert "command" in _fields(_refused({**CMD, "command": ["true"] * (limits.MAX_ARGS + 1)}))


def test_a_spec_over_the_line_budget_is_refused_naming_its_largest_field() -> None:
    """Each value within its bound, the sum over: 200 values of 6-byte escapes (\\u0001) each."""
    env = {f"V{i}": "\x01" * limits.MAX_ENV_VALUE_CHARS for i in range(20)}
    errors = _refused({**CMD, "env": env})
    message = str(errors[0]["msg"])
    assert "bytes as JSON" in message and "env" in message, message


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"command": ["sh -c 'rm -rf ~/x'"]}, "command", "shell command line"),
        ({"command": ["  "]}, "command", "must name a program"),
        ({"vllm_args": ["--dtype float32; rm -rf /"]}, "vllm_args", "own item"),
        ({"vllm_args": ["--max-model-len\t4096"]}, "vllm_args", "own item"),
    ],
)
def test_shell_strings_where_an_argv_belongs_are_refused(
    change: dict[str, Any], field: str, words: str
) -> None:
    base = CMD if "command" in change else EXTRACT
    errors = _refused({**base, **change})
    assert _fields(errors) == [field] and words in str(errors[0]["msg"])


def test_argv_items_are_passed_verbatim_otherwise() -> None:
    """No shell: metacharacters inside one item are text, and an explicit shell argv is allowed."""
    spec = parse_spec({**CMD, "command": ["sh", "-c", "echo a; echo $HOME"]})
    assert spec.command == ["sh", "-c", "echo a; echo $HOME"]
    args = ["--dtype=float32", "--hf-overrides", '{"a": 1, "b": "x y"}', "--seed", "-1"]
    assert parse_spec({**EXTRACT, "vllm_args": args}).vllm_args == args


def test_lone_surrogates_in_rules_are_refused_not_crashing_the_encoder() -> None:
    """Typed str fields refuse them already; free-form rules would fail only at protocol.encode."""
    errors = _refused(
        {**CMD, "rules": [{"name": "x", "kind": "warning", "regex": "a", "contains": ["\ud800"]}]}
    )
    assert "rules" in str(errors[0]["msg"]) and "Unicode" in str(errors[0]["msg"])


def _launch_line(spec: dict[str, Any]) -> bytes:
    """The line the controller writes for this spec (controller/link.py: protocol.encode of the request)."""
    return encode({"id": 2**63, "op": "launch", "run": "r" * 64, "spec": spec})


def test_the_largest_valid_spec_fits_one_protocol_line() -> None:
    """Grow a worst-case spec (6-byte escapes everywhere) until the model refuses; the last valid one fits."""
    valid: dict[str, Any] | None = None
    for n in range(1, 64):
        spec = {
            **CMD,
            "command": ["true", *["\x01" * 4096] * n],
            "env": {f"V{i}": "\x02" * 4096 for i in range(n)},
            "rules": [
                {"name": f"r{i}", "kind": "warning", "regex": "a", "contains": ["\x03" * 1024]}
                for i in range(min(n, limits.MAX_RULES))
            ],
        }
        try:
            valid = parse_spec(spec).model_dump(mode="json")
        except ValidationError:
            break
    else:
        pytest.fail("the spec never grew past the budget")
    assert valid is not None
    line = _launch_line(valid)
    assert limits.MAX_SPEC_BYTES // 2 < len(line) <= MAX_LINE_BYTES
    assert decode_request(line).args["spec"] == valid
    JobSpec.parse(valid)  # the daemon's view agrees


def test_daemon_launches_a_spec_near_the_budget_and_refuses_one_over_it(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    """A real daemon: near MAX_SPEC_BYTES launches; over it (still under a line) is bad_args naming size."""
    big = "x" * (limits.MAX_ENV_VALUE_CHARS - 16)
    n = limits.MAX_SPEC_BYTES // len(big) - 1
    spec = parse_spec({**CMD, "env": {f"V{i}": big for i in range(n)}}).model_dump(mode="json")
    assert limits.spec_bytes(spec) > limits.MAX_SPEC_BYTES * 0.9
    with AgentClient(agent_daemon.socket) as c:
        result = c.result("launch", run="near", spec=spec)
        assert result["pid"] > 0
        over = {**spec, "env": {**spec["env"], "W1": big, "W2": big, "W3": big}}
        assert len(_launch_line(over)) < MAX_LINE_BYTES
        with pytest.raises(AgentError) as err:
            c.result("launch", run="over", spec=over)
        assert err.value.code == "bad_args" and "bytes as JSON" in str(err.value)
    stored = json.loads((agent_daemon.state_dir / "runs" / "near" / "spec.json").read_text())
    assert stored == spec


def test_limits_leave_room_for_the_envelope() -> None:
    assert limits.MAX_SPEC_BYTES + limits.ENVELOPE_BYTES < MAX_LINE_BYTES
    assert limits.MAX_BODY_BYTES == MAX_LINE_BYTES
