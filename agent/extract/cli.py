"""Entry point `extract --spec RUN.json` (dispatched by agent/cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from agent.backends import PIPELINES, Backend
from agent.extract import signals

if TYPE_CHECKING:
    from agent.extract.planning.dataset import Sample
    from agent.extract.planning.preflight import Plan


def run_extract(argv: list[str]) -> int:
    """Run one extraction job; 0 done, 1 failed (a `failed` line says why), 2 cannot start (bad spec)."""
    p = argparse.ArgumentParser(prog="eaglewatch-agent extract", description="hidden-state extraction job")
    p.add_argument("--spec", required=True, help="run spec JSON file")
    p.add_argument(
        "--forecast",
        action="store_true",
        help='print {"bytes", "free_bytes", "fits", "estimated"} as one JSON object and start nothing',
    )
    p.add_argument(
        "--capture",
        action="store_true",
        help="print the capture the spec asks for (layers, convention, model, config sha256, dtype, backend) "
        "as one JSON object and start nothing",
    )
    p.add_argument("--worker-extension", help="vLLM worker extension class (tests: a subclass of ours)")
    p.add_argument(
        "--results-between-batches",
        action="store_true",
        help="take each drain's results in between batches, not beside the next one (tests)",
    )
    args = p.parse_args(argv)

    from agent.extract.planning.preflight import SpecError, load_spec, preflight

    if args.forecast or args.capture:
        return _print_one(args.spec, args.forecast)
    try:
        spec = load_spec(args.spec)
        if spec.backend in PIPELINES:
            from agent.extract.pipelines.run import run_pipeline

            return run_pipeline(spec)
        plan = preflight(spec)
    except SpecError as e:
        return signals.cannot_start(e)
    from agent.extract.planning.dataset import DatasetError, count, load

    try:
        window = None
        if spec.shard is not None:
            window = spec.shard.bounds(count(plan.spec.dataset or "", spec.max_samples))
        samples = load(plan.spec.dataset or "", plan.model_dir, spec.seq_len, spec.max_samples, window)
    except DatasetError as e:
        return signals.cannot_start(e)
    return _run(plan, samples, window, args.worker_extension, not args.results_between_batches)


def _print_one(path: str, forecast: bool) -> int:
    """`extract --spec S --forecast|--capture`: one JSON object on stdout, exit 0; 2 with a message when it
    cannot be told (a bad spec, an unreadable model or dataset, a backend that captures nothing of ours)."""
    from agent.extract.planning.forecast import forecast_spec
    from agent.extract.planning.preflight import SpecError, load_spec
    from agent.extract.writing.writer import wanted_capture

    try:
        spec = load_spec(path)
        if not forecast:
            result = wanted_capture(spec).to_dict()
        elif spec.backend == Backend.COMMAND:
            raise SpecError(f"backend '{Backend.COMMAND}' writes nothing the job knows of: no forecast")
        elif spec.backend in PIPELINES:
            from agent.extract.pipelines.forecast import forecast_pipeline

            result = forecast_pipeline(spec).to_dict()
        else:
            result = forecast_spec(spec).to_dict()
    except (SpecError, OSError) as e:
        return signals.cannot_start(e, failed=False)
    print(json.dumps(result), flush=True)
    return 0


def _run(
    plan: Plan,
    samples: list[Sample],
    window: tuple[int, int] | None,
    extension: str | None,
    overlap_results: bool,
) -> int:
    from agent import settings
    from agent.extract.capture.stats import RunStats
    from agent.extract.engine import driver, setup
    from agent.extract.planning.forecast import forecast_lengths, refuse_overrun
    from agent.extract.planning.preflight import SpecError
    from agent.extract.writing.writer import (
        MANIFEST,
        ST_DTYPES,
        Manifest,
        OutputDirTaken,
        card_spec,
        config_sha256,
        existing_valid,
        take_output_dir,
        versions,
        wanted_capture,
    )

    spec = plan.spec
    out = spec.output_dir or "."
    try:  # the daemon refuses another capture's directory at launch: this is the last guard
        wanted = wanted_capture(spec)
        take_output_dir(out, settings.RUN_ID.get() or "", wanted, (s.idx for s in samples))
    except (OutputDirTaken, SpecError) as e:
        return signals.cannot_start(e)
    os.environ.update(spec.env)  # before vLLM is imported: CUDA_VISIBLE_DEVICES and friends
    t0 = time.monotonic()
    name = spec.shard.manifest_name() if spec.shard is not None else MANIFEST
    dtype_hint = ST_DTYPES.get(wanted.dtype)  # None: an engine dtype without a code accepts any float file
    shard = None
    if spec.shard is not None and window is not None:
        shard = {"index": spec.shard.index, "count": spec.shard.count, "start": window[0], "end": window[1]}
    manifest = Manifest(
        model=str(plan.model_dir),
        layer_ids=plan.layer_ids,
        layer_convention=spec.layer_convention,
        hidden_size=plan.hidden_size,
        dtype=plan.dtype,
        backend=spec.backend,
        command=[sys.executable, *sys.argv],
        samples_total=len(samples),
        versions=versions(),
        model_config_sha256=config_sha256(plan.model_dir),
        spec=card_spec(spec.model_dump(mode="json")),
        name=name,
        shard=shard,
    )
    todo = []
    for s in samples:
        if existing_valid(out, s.idx, list(s.token_ids), len(plan.layer_ids), plan.hidden_size, dtype_hint):
            manifest.sample_tokens[s.idx] = len(s.token_ids)
        else:
            todo.append(s)
    if manifest.sample_tokens:
        signals.say(
            f"resuming: {len(manifest.sample_tokens)} of {len(samples)} samples already valid in {out}"
        )
    need = forecast_lengths(
        [len(s.token_ids) for s in todo], len(plan.layer_ids), plan.hidden_size, wanted.dtype, out
    )
    signals.emit("forecast", **need.to_dict())
    if refuse_overrun(need, out, spec.allow_disk_overrun):
        return 2
    prog = driver.Progress(
        total=len(samples),
        done=len(manifest.sample_tokens),
        files=len(manifest.sample_tokens),
        out_dir=out,
        tokens_todo=need.tokens,
        bytes_todo=need.bytes,
        disk_low_bytes=spec.disk_low_gib * 2**30,
        stats=RunStats(plan.layer_ids),
    )
    manifest.save(out)
    try:
        if todo:
            if spec.backend == Backend.VLLM_NATIVE:
                from agent.extract.engine.native import run_native

                run_native(plan, todo, manifest, prog)
            else:
                extension = extension or driver.WORKER_EXTENSION
                driver.run_worker_extension(plan, todo, manifest, prog, extension, overlap_results)
    except setup.CaptureFailed as e:
        signals.emit("failed", reason=str(e))
        signals.say(f"FAILED: {e}")
        return 1
    except Exception as e:
        traceback.print_exc()
        signals.emit("failed", reason=f"{type(e).__name__}: {e}")
        return 1
    secs = round(time.monotonic() - t0, 2)
    tokens = sum(manifest.sample_tokens.values())
    extra: dict[str, Any] = {}
    if shard is not None:  # the last shard to complete writes the merged manifest.json
        from agent.extract.writing.shards import MergeError, merge_dir

        try:
            merged = len(merge_dir(out)["shards"])
        except MergeError as e:
            signals.say(f"manifest.json not merged yet: {e}")
            extra = {"shard": shard, "merged": False}
        else:
            signals.say(f"all {merged} shards complete: merged manifest.json written in {out}")
            extra = {"shard": shard, "merged": True}
    if prog.capture_costs:
        extra["capture_costs"] = prog.capture_costs
    signals.emit(
        "completed",
        samples=len(manifest.sample_tokens),
        files=len(manifest.sample_tokens),
        tokens=tokens,
        seconds=secs,
        sp_gathers=prog.sp_gathers,
        engine_seconds=round(prog.engine_s, 3),
        drain_seconds=round(prog.drain_s, 3),
        results_seconds=round(prog.results_s, 3),
        results_wait_seconds=round(prog.results_wait_s, 3),
        **extra,
    )
    signals.say(f"completed: {len(manifest.sample_tokens)} samples, {tokens} tokens in {secs} s -> {out}")
    return 0
