"""vLLM's engine-core exit: fatal before the job's completion marker, normal_shutdown (info) after it."""

from __future__ import annotations

from agent.milestones.engine import MilestoneEngine, load_rules
from agent.runs.summary import RunSummary, final_state

RULES = load_rules()
# Lines as vLLM 0.32 prints them (the client's line at shutdown; the job's own completion marker).
ENGINE_DIED = (
    "(APIServer pid=1) ERROR 11-29 09:21:03 [core_client.py:564] Engine core proc EngineCore_DP0 died "
    "unexpectedly, shutting down client."
)
COMPLETED = (
    '(APIServer pid=1) INFO 11-29 09:21:02 [driver.py:90] EAGLEWATCH {"kind": "completed", "samples": 16}'
)


def _events(lines: list[str]) -> list[dict[str, object]]:
    eng = MilestoneEngine(RULES)
    out = eng.feed_many(lines, 1) + eng.flush()
    return [{"type": "milestone", **m.to_dict()} for m in out]


def test_engine_exit_after_completion_is_normal_shutdown() -> None:
    """After the marker: an info milestone, no error, and the run completes."""
    events = _events([COMPLETED, ENGINE_DIED])
    assert [e["kind"] for e in events] == ["completed", "normal_shutdown"]
    fields = events[1]["fields"]
    assert isinstance(fields, dict) and fields["severity"] == "info" and "class" not in fields
    summary = RunSummary.from_events(events)
    assert summary.last_error is None
    assert final_state({"code": 0}, None, summary, "vllm")[0] == "completed"


def test_engine_exit_before_completion_stays_fatal() -> None:
    """Before the marker the same line is a fatal error: exit code 0 does not make the run good."""
    events = _events([ENGINE_DIED, COMPLETED])
    assert [e["kind"] for e in events] == ["error", "completed"]
    summary = RunSummary.from_events(events)
    assert summary.first_fatal is not None
    state, reason = final_state({"code": 0}, None, summary, "vllm")
    assert state == "failed" and "engine_failed" in reason


def test_completion_survives_a_restart() -> None:
    """A daemon restarted between the marker and the shutdown line still calls it normal."""
    eng = MilestoneEngine(RULES)
    eng.feed_many([COMPLETED], 1)
    eng.flush()
    again = MilestoneEngine.restore(RULES, eng.snapshot())
    assert [m.kind for m in again.feed_many([ENGINE_DIED], 2) + again.flush()] == ["normal_shutdown"]
