"""Merge a sharded run's shard manifests into one `manifest.json`: `eaglewatch-agent merge-manifests DIR`.

Standard library only: it runs wherever the shards' files were gathered (the last shard runs it too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from agent.checks.dirs import MERGED_MANIFEST as MERGED
from agent.checks.dirs import SHARD_MANIFEST

#: Fields every shard of one run must agree on: a dataset mixing them is not usable as one.
SAME = (
    "format_version",
    "format",
    "model",
    "layer_ids",
    "layer_convention",
    "hidden_size",
    "dtype",
    "backend",
    "model_config_sha256",
)


class MergeError(ValueError):
    """The shard manifests cannot (yet) be merged; the message says which shard or field."""


def shard_manifests(out_dir: str | Path) -> dict[tuple[int, int], Path]:
    """(index, count) → path of every shard manifest in out_dir."""
    found: dict[tuple[int, int], Path] = {}
    try:
        names = os.listdir(out_dir)
    except OSError:
        return found
    for name in names:
        m = SHARD_MANIFEST.match(name)
        if m is not None:
            found[(int(m["index"]), int(m["count"]))] = Path(out_dir) / name
    return found


def merge_docs(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The merged manifest of one run's complete shard manifests (pure); MergeError says what is wrong."""
    if not docs:
        raise MergeError("no shard manifests (manifest.shard-I-of-N.json) to merge")
    counts = {d["shard"]["count"] for d in docs}
    if len(counts) != 1:
        raise MergeError(f"shard manifests of different shard counts: {sorted(counts)}")
    count = counts.pop()
    by_index = {d["shard"]["index"]: d for d in docs}
    missing = [i for i in range(count) if i not in by_index]
    if missing:
        raise MergeError(f"shards {missing} of {count} have no manifest yet")
    ordered = [by_index[i] for i in range(count)]
    first = ordered[0]
    for d in ordered:
        i = d["shard"]["index"]
        for key in SAME:
            if d.get(key) != first.get(key):
                raise MergeError(f"shard {i}: {key} {d.get(key)!r} differs from shard 0's {first.get(key)!r}")
        if d["samples_written"] != d["samples_total"]:
            done, total = d["samples_written"], d["samples_total"]
            raise MergeError(f"shard {i} is incomplete: {done} of {total} samples")
    end = 0
    for d in ordered:
        if d["shard"]["start"] != end:
            raise MergeError(f"shard {d['shard']['index']} starts at {d['shard']['start']}, expected {end}")
        end = d["shard"]["end"]
    samples: dict[str, int] = {}
    for d in ordered:
        samples.update(d["samples"])
    keep = (
        *SAME,
        "num_layers_captured",
        "versions",
        "vllm_version",
        "command",
        "spec",
        "layer_stats_per_file",
    )
    merged = {k: first[k] for k in keep if k in first}
    if isinstance(merged.get("spec"), dict):
        merged["spec"] = {k: v for k, v in merged["spec"].items() if k != "shard"}
    merged |= {
        "samples_total": sum(d["samples_total"] for d in ordered),
        "samples_written": len(samples),
        "tokens_total": sum(samples.values()),
        "samples": dict(sorted(samples.items(), key=lambda kv: int(kv[0]))),
        "bytes_written": sum(int(d.get("bytes_written") or 0) for d in ordered),
        "layer_stats": merge_layer_stats([d.get("layer_stats") or {} for d in ordered]),
        "started_at": min(d["started_at"] for d in ordered),
        "updated_at": time.time(),
        "shards": [
            {**d["shard"], "samples_written": d["samples_written"], "tokens_total": d["tokens_total"]}
            for d in ordered
        ],
    }
    return merged


def merge_layer_stats(per_shard: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The shards' per-layer statistics as one run's (pure): weighted by each shard's `values`.

    max_abs is the largest, non_finite and values add up, zero_fraction is exact; rms is exact when no
    value was non-finite (a shard's manifest keeps no count of its finite values).
    """
    out: dict[str, dict[str, Any]] = {}
    for layer in sorted({k for stats in per_shard for k in stats}, key=int):
        parts = [s[layer] for s in per_shard if layer in s and s[layer].get("values")]
        n = sum(int(p["values"]) for p in parts)
        if not n:
            continue
        out[layer] = {
            "rms": math.sqrt(sum(float(p["rms"]) ** 2 * int(p["values"]) for p in parts) / n),
            "max_abs": max(float(p["max_abs"]) for p in parts),
            "zero_fraction": sum(float(p["zero_fraction"]) * int(p["values"]) for p in parts) / n,
            "non_finite": sum(int(p["non_finite"]) for p in parts),
            "values": n,
        }
    return out


def merge_dir(out_dir: str | Path) -> dict[str, Any]:
    """Read out_dir's shard manifests, write the merged manifest.json atomically and return it."""
    docs = []
    for (index, count), path in sorted(shard_manifests(out_dir).items()):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            shard = doc["shard"]
            if (shard["index"], shard["count"]) != (index, count):
                raise MergeError(f"{path.name} records shard {shard['index']} of {shard['count']}")
        except (OSError, ValueError, TypeError, KeyError) as e:
            if isinstance(e, MergeError):
                raise
            raise MergeError(f"{path}: not a readable shard manifest ({e})") from None
        docs.append(doc)
    merged = merge_docs(docs)
    path = Path(out_dir) / MERGED
    # pid in the temp name: two last shards finishing together each write whole files, never one mixed
    tmp = path.with_name(f".{MERGED}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, indent=2) + "\n")
    os.replace(tmp, path)
    return merged


def run(argv: list[str]) -> int:
    """`merge-manifests DIR`: 0 and a JSON summary when merged, 1 and the reason when not."""
    p = argparse.ArgumentParser(
        prog="eaglewatch-agent merge-manifests", description="merge shard manifests into manifest.json"
    )
    p.add_argument("dir", help="output dir holding manifest.shard-I-of-N.json files")
    args = p.parse_args(argv)
    try:
        merged = merge_dir(args.dir)
    except MergeError as e:
        print(f"eaglewatch-agent merge-manifests: {e}", file=sys.stderr)
        return 1
    summary = {k: merged[k] for k in ("samples_total", "samples_written", "tokens_total")}
    print(json.dumps({"manifest": str(Path(args.dir) / MERGED), "shards": len(merged["shards"]), **summary}))
    return 0
