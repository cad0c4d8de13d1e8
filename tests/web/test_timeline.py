"""The run page's milestone rows: engine configuration and passed checks folded, shutdown noise marked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from web.timeline import passed_files, timeline_rows


@dataclass
class M:
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


RUN = [
    M("engine_config", {"version": "0.19.1", "config": "model='/m'"}),
    M("shape_check_passed", {"file": "hs_0.safetensors"}),
    M("engine_config", {"max_model_len": 2048}),
    M("shape_check_failed", {"file": "hs_1.safetensors"}),
    M("shape_check_passed", {"file": "hs_2.safetensors"}),
    M("warning", {"note": "slow"}),
    M("completed", {}),
    M("error", {"note": "engine core died unexpectedly"}),
]


def test_folded_rows_and_shutdown_noise() -> None:
    rows = timeline_rows(RUN, "completed")
    assert [r.first.kind for r in rows] == [
        "engine_config", "shape_check_passed", "shape_check_failed", "warning", "completed", "error",
    ]  # fmt: skip
    assert rows[0].summary == "vLLM 0.19.1 · 2 lines" and rows[1].summary == "2 files passed"
    assert [r.normal for r in rows] == [False] * 5 + [True]
    assert passed_files(RUN) == 2


def test_an_error_after_completion_of_a_failed_run_is_not_normal() -> None:
    assert not any(r.normal for r in timeline_rows(RUN, "failed"))


def test_a_normal_shutdown_milestone_is_marked_normal() -> None:
    """The agent's normal_shutdown (an engine exit after the completion marker) reads as normal even when
    a later check failed the run."""
    rows = timeline_rows([M("completed"), M("normal_shutdown", {"severity": "info"})], "failed")
    assert [r.normal for r in rows] == [False, True]
