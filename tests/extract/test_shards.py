"""Sharded runs without an engine: the `shard` spec field, dataset slices, merging shard manifests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agent.extract.planning.dataset import count, load
from agent.extract.writing.shards import MergeError, merge_docs, merge_layer_stats
from agent.spec import Shard, parse_spec
from tests.extract.jobrun import ROOT

BASE = {"host": "h", "model": "/m", "dataset": "/d.jsonl", "output_dir": "/out"}


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ({"index": 2, "count": 2}, "shard index must be below count: got index 2 of count 2"),
        ({"index": -1, "count": 2}, "greater than or equal to 0"),
        ({"index": 0, "count": 0}, "greater than or equal to 1"),
        ({"index": 0}, "Field required"),
        ({"index": "0", "count": 2}, "valid integer"),
        ({"index": 0, "count": 2, "rank": 1}, "not a spec field"),
    ],
)
def test_bad_shard_is_a_field_error(shard: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_spec({**BASE, "shard": shard})
    assert message in str(e.value) and "shard" in str(e.value)


def test_shard_is_refused_for_a_watched_command() -> None:
    with pytest.raises(ValidationError, match="'shard' and 'shards' need an extraction backend"):
        parse_spec(
            {"host": "h", "backend": "command", "command": ["/bin/true"], "shard": {"index": 0, "count": 2}}
        )


def test_spec_keeps_the_shard_and_names_its_manifest() -> None:
    spec = parse_spec({**BASE, "shard": {"index": 1, "count": 4}})
    assert spec.shard is not None and spec.shard.manifest_name() == "manifest.shard-1-of-4.json"
    assert spec.model_dump(mode="json")["shard"] == {"index": 1, "count": 4}
    assert parse_spec(BASE).shard is None


@pytest.mark.parametrize("total", [0, 1, 2, 5, 7, 10, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_shard_bounds_cover_every_sample_once_in_order(total: int, n: int) -> None:
    bounds = [Shard(index=i, count=n).bounds(total) for i in range(n)]
    assert [k for a, b in bounds for k in range(a, b)] == list(range(total))
    assert bounds[1 % n] == ((1 % n) * total // n, ((1 % n) + 1) * total // n)


def test_dataset_window_keeps_global_indices(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    rows = [[i + 1, i + 2] for i in range(7)]
    data.write_text(
        "\n".join(json.dumps({"token_ids": r}) for r in rows[:3])
        + "\n\n"
        + "".join(json.dumps({"token_ids": r}) + "\n" for r in rows[3:])
    )
    assert count(data, None) == 7 and count(data, 5) == 5 and count(data, 100) == 7
    whole = load(data, tmp_path, 8, None)
    parts = [load(data, tmp_path, 8, None, Shard(index=i, count=3).bounds(7)) for i in range(3)]
    assert [s.idx for s in parts[1]] == [2, 3] and parts[1][0].token_ids == (3, 4)
    assert [s for p in parts for s in p] == whole
    assert load(data, tmp_path, 8, 5, (4, 7)) == whole[4:5]  # max_samples still ends the run
    assert load(data, tmp_path, 8, None, (3, 3)) == []  # an empty slice is not an error


def test_count_sees_the_lines_load_sees(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"token_ids": [1]}\r{"token_ids": [2]}\r\n\n{"token_ids": [3]}\n')
    assert count(data, None) == len(load(data, tmp_path, 8, None)) == 3


def test_a_shard_does_not_parse_other_shards_lines(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"token_ids": [1]}\n{"token_ids": [2]}\nnot json\n')
    assert [s.idx for s in load(data, tmp_path, 8, None, (0, 2))] == [0, 1]


def _doc(index: int, count: int, start: int, end: int, **over: Any) -> dict[str, Any]:
    samples = {str(k): k + 1 for k in range(start, end)}
    doc = {
        "format_version": 1,
        "format": "speculators-safetensors",
        "model": "/m",
        "layer_ids": [2, 4],
        "layer_convention": "input",
        "num_layers_captured": 2,
        "hidden_size": 8,
        "dtype": "float32",
        "backend": "worker-extension",
        "versions": {},
        "command": ["x"],
        "samples_total": end - start,
        "samples_written": end - start,
        "tokens_total": sum(samples.values()),
        "samples": samples,
        "started_at": 100.0 + index,
        "updated_at": 200.0,
        "shard": {"index": index, "count": count, "start": start, "end": end},
    }
    return doc | over


def test_merge_totals_and_samples_of_all_shards() -> None:
    merged = merge_docs([_doc(1, 2, 5, 10), _doc(0, 2, 0, 5)])
    assert merged["samples_total"] == merged["samples_written"] == 10
    assert list(merged["samples"]) == [str(k) for k in range(10)]
    assert merged["tokens_total"] == sum(range(1, 11)) and merged["started_at"] == 100.0
    assert [s["index"] for s in merged["shards"]] == [0, 1] and merged["shards"][1]["tokens_total"] == 40
    assert "shard" not in merged and merged["layer_ids"] == [2, 4]


@pytest.mark.parametrize(
    ("docs", "message"),
    [
        ([], "no shard manifests"),
        ([_doc(0, 3, 0, 2), _doc(2, 3, 4, 6)], r"shards \[1\] of 3 have no manifest yet"),
        ([_doc(0, 2, 0, 5), _doc(1, 2, 5, 10, samples_written=3)], "shard 1 is incomplete: 3 of 5"),
        ([_doc(0, 2, 0, 5), _doc(1, 2, 5, 10, hidden_size=16)], "shard 1: hidden_size 16 differs"),
        ([_doc(0, 2, 0, 5), _doc(1, 2, 6, 10)], "shard 1 starts at 6, expected 5"),
        ([_doc(0, 2, 0, 5), _doc(0, 3, 0, 3)], "different shard counts"),
    ],
)
def test_merge_refuses_what_is_not_one_dataset(docs: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(MergeError, match=message):
        merge_docs(docs)


def _merge_cli(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", "merge-manifests", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_merge_manifests_command_writes_manifest_json(tmp_path: Path) -> None:
    (tmp_path / "manifest.shard-0-of-2.json").write_text(json.dumps(_doc(0, 2, 0, 3)))
    p = _merge_cli(tmp_path)
    assert p.returncode == 1 and "shards [1] of 2 have no manifest yet" in p.stderr
    assert not (tmp_path / "manifest.json").exists()
    (tmp_path / "manifest.shard-1-of-2.json").write_text(json.dumps(_doc(1, 2, 3, 7)))
    p = _merge_cli(tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["samples_written"] == 7
    merged = json.loads((tmp_path / "manifest.json").read_text())
    assert merged["samples_total"] == 7 and len(merged["shards"]) == 2
    assert sorted(x.name for x in tmp_path.iterdir()) == [
        "manifest.json",
        "manifest.shard-0-of-2.json",
        "manifest.shard-1-of-2.json",
    ]


def test_layer_stats_merge_weighted_by_values() -> None:
    a = {"2": {"rms": 1.0, "max_abs": 3.0, "zero_fraction": 0.5, "non_finite": 0, "values": 10}}
    b = {
        "2": {"rms": 2.0, "max_abs": 2.0, "zero_fraction": 0.0, "non_finite": 1, "values": 30},
        "4": {"rms": 1.5, "max_abs": 1.0, "zero_fraction": 0.0, "non_finite": 0, "values": 5},
    }
    got = merge_layer_stats([a, b, {}])
    assert got["2"] == {
        "rms": pytest.approx((13 / 4) ** 0.5),
        "max_abs": 3.0,
        "zero_fraction": pytest.approx(0.125),
        "non_finite": 1,
        "values": 40,
    }
    assert got["4"]["values"] == 5 and list(got) == ["2", "4"]
    assert (
        merge_docs([_doc(0, 2, 0, 1, layer_stats=a), _doc(1, 2, 1, 2, layer_stats=b)])["layer_stats"] == got
    )
