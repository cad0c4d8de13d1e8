"""Pure sharding decisions: placement over hosts and GPU groups, shard specs, one state and progress."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from agent.spec import Shard, parse_spec
from controller.sharding import (
    Placement,
    PlacementError,
    cpu_groups,
    gpu_indices,
    job_document,
    place,
    run_progress,
    run_state,
    shard_spec,
)
from controller.shardruns import shard_jobs


def test_round_robin_over_hosts_with_gpu_groups() -> None:
    assert place(3, [("a", [0, 1, 2, 3]), ("b", [0, 1])], tp=2) == [
        Placement(0, "a", (0, 1)),
        Placement(1, "b", (0, 1)),
        Placement(2, "a", (2, 3)),
    ]


def test_eight_tp1_engines_on_one_eight_gpu_host() -> None:
    got = place(8, [("h", list(range(8)))], tp=1)
    assert [p.gpus for p in got] == [(i,) for i in range(8)]


def test_too_many_shards_for_a_hosts_gpus_is_refused() -> None:
    with pytest.raises(
        PlacementError, match=r"host b has 2 GPUs \(1 groups of tensor_parallel_size 2\) but 2"
    ):
        place(4, [("a", [0, 1, 2, 3]), ("b", [0, 1])], tp=2)
    with pytest.raises(PlacementError, match="at least one host"):
        place(2, [], tp=1)


def test_cpu_hosts_get_no_gpus_and_any_number_of_shards() -> None:
    assert place(3, [("cpu", [])], tp=2) == [Placement(i, "cpu", None) for i in range(3)]


def test_gpu_indices_from_the_spec_env_or_the_host() -> None:
    gpus = [{"index": 1, "name": "H200"}, {"index": 0, "name": "H200"}]
    assert gpu_indices(gpus, {}) == [0, 1]
    assert gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": "4, 5,6"}) == [4, 5, 6]
    assert gpu_indices([], {}) == []


def test_a_shards_job_document_is_the_runs_with_its_host_shard_and_gpus() -> None:
    """What a shard's run row stores and its agent gets: the run's spec, field for field and in order, with
    its host, its shard and its GPUs, without ``shards``; a valid spec on its own."""
    base = {"model": "/m", "dataset": "/d.jsonl", "output_dir": "/o", "env": {"X": "1"}}
    run = parse_spec({**base, "host": ["a", "b"], "shards": 2})
    doc = job_document(shard_spec(run, Placement(1, "b", (2, 3)), 2))
    want = {k: v for k, v in run.model_dump(mode="json").items() if k != "shards"}
    want.update(host="b", shard={"index": 1, "count": 2}, env={"X": "1", "CUDA_VISIBLE_DEVICES": "2,3"})
    assert doc == want and list(doc) == list(want)
    assert parse_spec(doc).shard == Shard(index=1, count=2)
    cpu = shard_spec(parse_spec({**base, "host": "a"}), Placement(0, "cpu", None), 2)
    assert "CUDA_VISIBLE_DEVICES" not in cpu.env


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        (["running", "failed"], "running"),  # the others go on
        (["completed", "starting"], "starting"),
        (["pending", "running", "unknown"], "running"),
        (["failed", "completed"], "failed"),
        (["stopped", "completed"], "stopped"),
        (["lost", "stopped"], "lost"),
        (["completed", "completed"], "completed"),
        ([], "pending"),
    ],
)
def test_one_state_for_the_run(states: list[str], expected: str) -> None:
    assert run_state(states) == expected


def test_progress_is_summed_over_reporting_shards() -> None:
    a = {"samples_done": 3, "samples_total": 5, "tokens_per_s": 10.3, "files_written": 3, "bytes_written": 9}
    b = {"samples_done": 1, "samples_total": 5, "tokens_per_s": 20.0, "files_written": 1, "bytes_written": 3}
    assert run_progress([a, None, b]) == {
        "samples_done": 4,
        "samples_total": 10,
        "files_written": 4,
        "bytes_written": 12,
        "tokens_per_s": 30.3,
        "shards_reporting": 2,
    }
    assert run_progress([None, None]) is None
    assert run_progress([{**a, "eta_s": 4.0}, {**b, "eta_s": 9.5}])["eta_s"] == 9.5  # the slowest shard


def test_spec_takes_shards_and_a_host_list() -> None:
    base = {"model": "/m", "dataset": "/d.jsonl", "output_dir": "/o"}
    spec = parse_spec({**base, "host": ["a", "b"], "shards": 4})
    assert spec.hosts == ["a", "b"] and spec.shards == 4
    assert parse_spec({**base, "host": ["a"]}).host == "a"  # one name in a list: an ordinary run
    refusals = [
        ({**base, "host": ["a", "b"]}, "shards is 1 but 2 hosts are given"),
        ({**base, "host": ["a", "a"], "shards": 2}, "host 'a' is listed twice"),
        ({**base, "host": [], "shards": 2}, "at least 1 item"),
        ({**base, "host": "a", "shards": 2, "shard": {"index": 0, "count": 2}}, "'shards' .* or 'shard'"),
        ({"host": "a", "backend": "command", "command": ["true"], "shards": 2}, "need an extraction backend"),
        ({**base, "host": "a", "shards": 0}, "greater than or equal to 1"),
    ]
    for data, message in refusals:
        with pytest.raises(ValidationError, match=message):
            parse_spec(data)


def test_shard_jobs_place_gpu_groups_from_the_hosts_gpus() -> None:
    spec = parse_spec(
        {"host": ["a", "b"], "shards": 3, "tensor_parallel_size": 2, "model": "/m", "dataset": "/d.jsonl",
         "output_dir": "/o", "env": {"HF_HOME": "/h"}}
    )  # fmt: skip
    gpus = json.dumps([{"index": i} for i in range(4)])
    jobs = shard_jobs(spec, {"a": {"gpus_json": gpus}, "b": {"gpus_json": "[]"}})
    assert [(j.index, j.host, j.gpus) for j in jobs] == [(0, "a", (0, 1)), (1, "b", None), (2, "a", (2, 3))]
    assert jobs[2].spec.env == {"HF_HOME": "/h", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert jobs[1].spec.env == {"HF_HOME": "/h"} and jobs[1].spec.host == "b"
    assert [j.spec.shard for j in jobs] == [Shard(index=i, count=3) for i in range(3)]
    with pytest.raises(PlacementError, match="host a has 4 GPUs"):
        shard_jobs(
            spec.model_copy(update={"shards": 5}), {"a": {"gpus_json": gpus}, "b": {"gpus_json": gpus}}
        )


def test_cpu_hosts_split_the_given_core_groups() -> None:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7|8-11|12-15"}
    assert cpu_groups(env) == ["0-3", "4-7", "8-11", "12-15"] and cpu_groups({}) == []
    assert cpu_groups({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == []
    got = place(2, [("cpu", [])], tp=2, cpus=cpu_groups(env))
    assert [p.cpus for p in got] == ["0-3|4-7", "8-11|12-15"]
    spec = {"host": "cpu", "model": "/m", "dataset": "/d.jsonl", "output_dir": "/o", "env": env}
    assert shard_spec(parse_spec(spec), got[1], 2).env == {"VLLM_CPU_OMP_THREADS_BIND": "8-11|12-15"}
    with pytest.raises(PlacementError, match=r"host cpu has no GPUs and 4 core groups .* but 3 shards"):
        place(3, [("cpu", [])], tp=2, cpus=cpu_groups(env))
    assert place(2, [("g", [0, 1])], tp=1, cpus=["0-3"])[1].cpus is None  # GPU hosts take GPUs
