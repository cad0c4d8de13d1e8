"""Sharded capture on the real vLLM CPU engine, tiny Llama fp32: two shards equal one run, file by file.

One module-scoped scenario (engine starts are expensive): shard 0 of 2 into one directory; there,
what a crash of shard 1 after its first batch leaves (its first two files: the whole run's, which are equal
bit for bit); shard 1, which resumes them and merges manifest.json as the last shard to finish; and shard 0
of 8 of the same seven samples, whose slice is empty. The whole run they are compared with is the
session's (tests/conftest.py ``sharded_whole``). Every assertion below reads these.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.extract.jobrun import IN_PROCESS_ENGINE, LAYERS, JobResult, run_job, write_spec
from tests.extract.jobrun import SHARD_LENGTHS as LENGTHS
from tests.extract.reference import same_capture

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def scenario(sharded_whole: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("shards")

    def spec(name: str, out: Path, **more: Any) -> Path:
        return write_spec(tmp / f"{name}.json", output_dir=str(out), **sharded_whole["common"], **more)

    sharded = tmp / "sharded"
    res: dict[str, Any] = {"whole": sharded_whole["out"], "one": sharded_whole["job"], "sharded": sharded}
    env = IN_PROCESS_ENGINE  # the shards' slicing and merge are the subject here, not vLLM's process layout
    res["s0"] = run_job(spec("s0", sharded, shard={"index": 0, "count": 2}), env=env)
    res["s0_files"] = _names(sharded)
    # A crash of shard 1 after its first batch leaves that batch's two files and no shard manifest. Made by
    # hand: a kill on the first batch's milestone (as in the Llama test) loses the race with this tiny
    # slice's second batch, and the files are the whole run's (equal batching: equal bits).
    for name in ("hs_3.safetensors", "hs_4.safetensors"):
        shutil.copyfile(sharded_whole["out"] / name, sharded / name)
    res["after_kill"] = sorted(set(_names(sharded)) - set(res["s0_files"]))
    res["resumed"] = run_job(spec("s1", sharded, shard={"index": 1, "count": 2}), env=env)
    res["empty_out"] = tmp / "empty"
    res["empty"] = run_job(spec("e", tmp / "empty", shard={"index": 0, "count": 8}), env=env)
    return res


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("hs_*.safetensors"))


def test_every_job_ends_as_expected(scenario: dict[str, Any]) -> None:
    for key in ("one", "s0", "resumed", "empty"):
        job: JobResult = scenario[key]
        assert job.rc == 0 and job.kinds()[-1] == "completed", (key, job.output[-3000:])
    # a shard writes its own slice only, with global indices
    assert scenario["s0_files"] == [f"hs_{i}.safetensors" for i in range(3)]
    assert scenario["after_kill"] == ["hs_3.safetensors", "hs_4.safetensors"]


def test_two_shards_equal_one_run_file_by_file(scenario: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file

    whole, sharded = scenario["whole"], scenario["sharded"]
    assert _names(sharded) == _names(whole) == sorted(f"hs_{i}.safetensors" for i in range(len(LENGTHS)))
    for name in _names(whole):
        a, b = load_file(str(whole / name)), load_file(str(sharded / name))
        assert torch.equal(a["token_ids"], b["token_ids"]), name
        assert same_capture(b["hidden_states"], a["hidden_states"]), name
    assert not list(sharded.glob(".*tmp")) and not (whole / "manifest.shard-0-of-1.json").exists()


def test_each_shard_counts_and_resumes_its_own_slice(scenario: dict[str, Any]) -> None:
    s0, resumed = scenario["s0"], scenario["resumed"]
    done0 = s0.of("completed")[0]
    assert done0["samples"] == 3 and done0["tokens"] == sum(LENGTHS[:3])
    assert done0["shard"] == {"index": 0, "count": 2, "start": 0, "end": 3} and done0["merged"] is False
    assert s0.of("progress")[-1]["samples_total"] == 3
    done1 = resumed.of("completed")[0]
    assert done1["shard"] == {"index": 1, "count": 2, "start": 3, "end": 7} and done1["merged"] is True
    assert f"resuming: {len(scenario['after_kill'])} of 4 samples already valid" in resumed.output
    rewritten = {e["file"] for e in resumed.of("shape_check_passed")}
    assert rewritten == {f"hs_{i}.safetensors" for i in range(3, 7)} - set(scenario["after_kill"])
    for i, (start, end) in enumerate([(0, 3), (3, 7)]):
        doc = json.loads((scenario["sharded"] / f"manifest.shard-{i}-of-2.json").read_text())
        assert doc["shard"] == {"index": i, "count": 2, "start": start, "end": end}
        assert doc["samples"] == {str(k): LENGTHS[k] for k in range(start, end)}


def test_merged_manifest_equals_the_whole_runs(scenario: dict[str, Any]) -> None:
    from agent.checks.checker import Expectation, check_path
    from agent.extract.writing.shards import merge_layer_stats

    one = json.loads((scenario["whole"] / "manifest.json").read_text())
    merged = json.loads((scenario["sharded"] / "manifest.json").read_text())
    for key in (
        "samples",
        "samples_total",
        "samples_written",
        "tokens_total",
        "layer_ids",
        "hidden_size",
        "dtype",
    ):
        assert merged[key] == one[key], key
    assert [(s["start"], s["end"], s["samples_written"]) for s in merged["shards"]] == [(0, 3, 3), (3, 7, 4)]
    # statistics and bytes cover each shard's last attempt (shard 1 was resumed): summed over the shards
    shards = [json.loads((scenario["sharded"] / f"manifest.shard-{i}-of-2.json").read_text()) for i in (0, 1)]
    assert merged["layer_stats"] == merge_layer_stats([d["layer_stats"] for d in shards])
    assert set(merged["layer_stats"]) == set(one["layer_stats"])
    assert merged["bytes_written"] == sum(d["bytes_written"] for d in shards) > 0
    assert "shard" not in merged["spec"] and merged["model_config_sha256"] == one["model_config_sha256"]
    report = check_path(scenario["sharded"], Expectation(layers=len(LAYERS), hidden_size=128))
    assert report.ok and report.files == len(LENGTHS), report.to_dict()


def test_an_empty_slice_completes_without_an_engine(scenario: dict[str, Any]) -> None:
    empty: JobResult = scenario["empty"]
    assert "engine_config" not in empty.kinds() and empty.of("completed")[0]["samples"] == 0
    doc = json.loads((scenario["empty_out"] / "manifest.shard-0-of-8.json").read_text())
    assert doc["shard"] == {"index": 0, "count": 8, "start": 0, "end": 0} and doc["samples_total"] == 0
    assert _names(scenario["empty_out"]) == []
