"""Log records that are not plain text lines: one-record ERROR exceptions, vLLM's JSON records, and the
config-compatibility AttributeError class."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.milestones.engine import Milestone, MilestoneEngine, load_rules
from agent.milestones.records import json_record_lines

RULES = load_rules()


def run_lines(lines: list[str], **kw: Any) -> list[Milestone]:
    """Feed lines 1..n, then flush."""
    eng = MilestoneEngine(RULES, **kw)
    out: list[Milestone] = []
    for i, text in enumerate(lines, 1):
        out += eng.feed(text, i)
    return out + eng.flush()


def errors(ms: list[Milestone]) -> list[Milestone]:
    return [m for m in ms if m.kind == "error"]


@pytest.mark.parametrize(
    ("line", "cls", "exc_type"),
    [
        (
            "(Worker pid=4242) ERROR 11-30 10:00:00 [multiproc_executor.py:857] RuntimeError: NCCL error: "
            "unhandled system error (run with NCCL_DEBUG=INFO for details)",
            "nccl",
            "RuntimeError",
        ),
        (
            "(Worker_TP1 pid=4243) ERROR 11-30 10:00:00 [multiproc_executor.py:857] AttributeError: The "
            "text_config extracted from the model config does not have num_attention_heads attribute",
            "config_incompatible",
            "AttributeError",
        ),
        (
            "(EngineCore pid=4000) ERROR 11-30 10:00:00 [core.py:1099] ValueError: max_model_len 9000 is "
            "larger than the model's maximum of 8192",
            "traceback",
            "ValueError",
        ),
    ],
)
def test_one_record_exception_becomes_a_classified_error(line: str, cls: str, exc_type: str) -> None:
    """An exception logged as one ERROR record, no Traceback line before it, is an error with its class."""
    (m,) = errors(run_lines([line]))
    assert (m.fields["class"], m.fields["exc_type"]) == (cls, exc_type)
    assert m.line == 1 and m.text == line
    said = m.fields.get("message") or m.fields.get("detail")  # a rule's own fields, or the exception's
    assert said and said in line


def test_one_record_exception_on_every_rank_is_one_error() -> None:
    """TP workers logging the same one-record exception give one error with their ranks."""
    lines = [
        f"(Worker_TP{r} pid={100 + r}) ERROR 11-30 10:00:00 [multiproc_executor.py:857] RuntimeError: NCCL "
        "error: unhandled system error"
        for r in range(4)
    ]
    (m,) = errors(run_lines(lines, world_size=4))
    assert m.fields["class"] == "nccl" and m.fields["ranks"] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "line",
    [
        "(Worker pid=1) ERROR 11-30 10:00:00 [core.py:1] Shutdown: Error count 3 exceeds the limit",
        "(Worker pid=1) INFO 11-30 10:00:00 [x.py:1] ValueError: only a word in an info line",
        "(Worker pid=1) ERROR 11-30 10:00:00 [x.py:1]     raise ValueError(msg)",
        "ValueError: outside any record or traceback",
    ],
)
def test_lines_that_are_not_one_record_exceptions(line: str) -> None:
    """Non-ERROR lines, frames and plain wording are not taken for an exception."""
    assert errors(run_lines([line])) == []


def record(message: str, level: str = "INFO", proc: str = "Worker_TP1", **extra: Any) -> str:
    """A vLLM JSON log record as python-json-logger writes it."""
    rec = {
        "asctime": "2026-11-30 10:00:03,512",
        "levelname": level,
        "name": "vllm.v1.worker.gpu_worker",
        "processName": proc,
        "process": 4242,
        "message": message,
        **extra,
    }
    return json.dumps(rec)


def test_json_records_are_read_like_text_lines() -> None:
    """Rank from processName, text from message; the milestone shows text, not JSON."""
    (m,) = run_lines([record("Available KV cache memory: 10.5 GiB")])
    assert m.kind == "kv_cache_ready" and m.fields["ranks"] == [1]  # per-rank rule: deduped, ranks in fields
    assert m.text == (
        "(Worker_TP1 pid=4242) INFO 11-30 10:00:03 [vllm.v1.worker.gpu_worker:0] "
        "Available KV cache memory: 10.5 GiB"
    )
    assert "{" not in m.text


def test_json_records_of_every_rank_dedupe_and_errors_classify() -> None:
    """Per-rank rules dedupe across JSON records; an ERROR record's exception is an error with its class."""
    lines = [record("Loading weights took 1.25 seconds", proc=f"Worker_TP{r}") for r in range(2)]
    lines.append(record("RuntimeError: NCCL error: unhandled system error", level="ERROR", proc="Worker_TP0"))
    ms = run_lines(lines, world_size=2)
    loaded = [m for m in ms if m.kind == "weights_loaded"]
    assert len(loaded) == 1 and loaded[0].fields["ranks"] == [0, 1]
    (err,) = errors(ms)
    assert (err.fields["class"], err.fields["ranks"], err.line) == ("nccl", [0], 3)


def test_json_record_with_exc_info_is_one_traceback_error() -> None:
    """A record logged with exc_info carries its traceback: one error classified by the exception."""
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/opt/vllm/vllm/model_executor/models/llava.py", line 520, in __init__\n'
        "    self.num_heads = config.text_config.num_attention_heads\n"
        "AttributeError: The text_config extracted from the model config does not have num_attention_heads "
        "attribute"
    )
    ms = run_lines([record("WorkerProc failed to start.", level="ERROR", exc_info=tb)])
    classes = [m.fields["class"] for m in errors(ms)]
    assert classes == ["engine_failed", "config_incompatible"]
    assert errors(ms)[1].fields["frames"] == ["llava.py:520 in __init__"]


@pytest.mark.parametrize(
    "text",
    [
        '{"message": "no level"}',
        '{"levelname": "INFO"}',
        "[1, 2]",
        "{not json",
        '{"levelname": "IN FO", "message": "x"}',
    ],
)
def test_other_json_lines_are_left_as_text(text: str) -> None:
    """Only objects with a level and a message are records."""
    assert json_record_lines(text) is None


def test_json_record_with_a_hostile_process_name_gets_no_prefix() -> None:
    """A processName that cannot be a prefix is dropped rather than forging another process's prefix."""
    (line,) = json_record_lines(record("hello", proc="x pid=1) (Worker_TP3")) or []
    assert line.startswith("INFO 11-30 10:00:03 ")


def test_feed_many_reads_json_records_like_feed() -> None:
    """The watcher feeds whole chunks through the prefilter: a JSON ERROR record whose words no rule names
    must still reach the engine (the gate judges the text lines a record stands for, not its JSON)."""
    lines = [record("Loading weights took 1.25 seconds", proc=f"Worker_TP{r}") for r in range(2)]
    lines += ["plain text line", record("ValueError: frobnicator broke", level="ERROR")]
    one, many = MilestoneEngine(load_rules(), world_size=2), MilestoneEngine(load_rules(), world_size=2)
    by_line = [m for i, t in enumerate(lines, 1) for m in one.feed(t, i)] + one.flush()
    batched = many.feed_many(lines, 1) + many.flush()
    assert [m.to_dict() for m in batched] == [m.to_dict() for m in by_line]
    assert [e.fields["exc_type"] for e in errors(batched)] == ["ValueError"]
