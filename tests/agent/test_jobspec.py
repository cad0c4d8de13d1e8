"""Table tests of the daemon's typed spec view (agent/runs/jobspec.py) against the pydantic run spec."""

from __future__ import annotations

from typing import Any

import pytest

from agent import limits
from agent.runs.jobspec import JobSpec, SpecError
from agent.spec import RunSpec


def test_defaults_are_the_run_spec_defaults() -> None:
    full = RunSpec(host="h", model="/m", dataset="/d.jsonl", output_dir="/o")
    view = JobSpec.parse({})
    assert (view.backend, view.tensor_parallel_size, view.on_shape_failure) == (
        full.backend,
        full.tensor_parallel_size,
        full.on_shape_failure,
    )
    assert (view.env, view.command, view.rules, view.layers) == ({}, [], [], None)


def test_a_validated_spec_reads_back_field_for_field() -> None:
    spec = RunSpec(
        host="h",
        name="r1",
        model="/m",
        dataset="/d.jsonl",
        output_dir="/o",
        layers=[2, 4],
        tensor_parallel_size=2,
        env={"A": "1"},
        on_shape_failure="stop",
        expect={"layers": 2, "hidden_size": 128},
    ).model_dump(mode="json")
    view = JobSpec.parse(spec)
    assert view == JobSpec(
        name="r1",
        backend="worker-extension",
        tensor_parallel_size=2,
        model="/m",
        layers=[2, 4],
        output_dir="/o",
        env={"A": "1"},
        on_shape_failure="stop",
        expect_layers=2,
        expect_hidden_size=128,
    )
    assert view.world_size == 2


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ([], "'spec' must be a JSON object"),
        ({"backend": "shell"}, "spec.backend"),
        ({"env": {"BAD NAME": "1"}}, "spec.env"),
        ({"env": {"A": 1}}, "spec.env"),
        ({"env": ["A"]}, "spec.env"),
        ({"on_shape_failure": "ignore"}, "spec.on_shape_failure"),
        ({"backend": "command"}, "spec.command"),
        ({"backend": "command", "command": []}, "spec.command"),
        ({"backend": "command", "command": ["a", 1]}, "spec.command"),
        ({"backend": "command", "command": ["a\0b"]}, "spec.command"),
        ({"rules": {"name": "x"}}, "spec.rules"),
        ({"env": {f"V{i}": "1" for i in range(limits.MAX_ENV_VARS + 1)}}, "spec.env"),
        ({"env": {"A": "x" * (limits.MAX_ENV_VALUE_CHARS + 1)}}, "spec.env"),
        ({"backend": "command", "command": ["true"] * (limits.MAX_ARGS + 1)}, "spec.command"),
        ({"backend": "command", "command": ["sh -c 'rm -rf ~/x'"]}, "spec.command[0]"),
        ({"rules": [{}] * (limits.MAX_RULES + 1)}, "spec.rules"),
        ({"backend": "command", "command": ["true"], "pad": "x" * limits.MAX_SPEC_BYTES}, "bytes as JSON"),
        ({"output_dir": 7}, "spec.output_dir"),
        ({"output_dir": "/"}, "spec.output_dir"),
    ],
)
def test_parse_refuses_what_a_launch_acts_on(spec: Any, names: str) -> None:
    with pytest.raises(SpecError) as err:
        JobSpec.parse(spec)
    assert names in str(err.value)


@pytest.mark.parametrize(
    ("spec", "field", "value"),
    [
        ({"tensor_parallel_size": "8"}, "tensor_parallel_size", 1),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", 1),
        ({"layers": "2,3"}, "layers", None),
        ({"expect": {"layers": -1}}, "expect_layers", None),
        ({"expect": [1]}, "expect_layers", None),
    ],
)
def test_fields_a_launch_does_not_act_on_fall_back_to_defaults(spec: Any, field: str, value: Any) -> None:
    assert getattr(JobSpec.parse(spec), field) == value


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, JobSpec()),
        ({"backend": "shell", "env": 3, "on_shape_failure": "x"}, JobSpec()),
        ({"backend": "command", "command": ["true"]}, JobSpec(backend="command", command=["true"])),
    ],
)
def test_stored_never_raises(spec: Any, expected: JobSpec) -> None:
    assert JobSpec.stored(spec) == expected


@pytest.mark.parametrize(
    ("backend", "tp", "world"),
    [("command", 8, None), ("worker-extension", 8, 8), ("vllm-native", 1, 1)],
)
def test_world_size(backend: str, tp: int, world: int | None) -> None:
    assert JobSpec(backend=backend, tensor_parallel_size=tp).world_size == world
