"""The extraction driver: start vLLM, feed batches, collect small per-sample results, signal progress."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from agent.extract import signals
from agent.extract.capture import stats
from agent.extract.capture.stats import RunStats
from agent.extract.engine import canary
from agent.extract.engine.setup import (
    CaptureFailed,
    engine_kwargs,
    one_result,
    prepare_engine,
    tuning_from_env,
)
from agent.extract.planning import forecast
from agent.extract.planning.dataset import Sample
from agent.extract.planning.preflight import Plan
from agent.extract.writing.writer import Manifest

#: vLLM's worker extension class (`extract --worker-extension` names a subclass for tests).
WORKER_EXTENSION = "agent.extract.capture.worker_ext.EagleWatchCapture"


@dataclass
class CanaryRound:
    """A canary round whose re-captures are submitted; its comparisons come back with later drains."""

    when: str
    expected: int
    dtype: str
    diffs: list[float | None] = field(default_factory=list)


@dataclass
class Progress:
    """Counters for progress lines."""

    total: int
    out_dir: str  # where free space is measured
    stats: RunStats  # per-layer statistics
    done: int = 0
    files: int = 0
    bytes: int = 0
    tokens: int = 0
    failed_checks: int = 0
    batches: int = 0
    sp_gathers: int = 0  # captured states that arrived sequence-parallel sharded (all-gathered by us)
    engine_s: float = 0.0  # inside llm.generate: the engine's steps with the capture running beside them
    drain_s: float = 0.0  # in eaglewatch_drain: waiting for writes the steps did not hide
    results_s: float = 0.0  # taking drained results in: checks reported, manifest saved, progress lines
    results_wait_s: float = 0.0  # the driver's share of results_s (the rest ran beside the next batch)
    started: float = field(default_factory=time.monotonic)
    tokens_todo: int = 0  # tokens this attempt captures in all: the ETA's numerator
    bytes_todo: int = 0  # bytes this attempt writes in all (the forecast)
    disk_low_bytes: int = 0  # the spec's disk_low_gib threshold
    capture_costs: dict[str, Any] | None = None  # where the capture's time went (costs.CaptureCosts)
    canaries: list[CanaryRound] = field(default_factory=list)  # rounds awaiting their comparisons
    collapses: list[dict[str, Any]] = field(default_factory=list)  # findings not yet reported

    def restart_clock(self) -> None:
        """Measure throughput from engine ready on, not from process start."""
        self.started = time.monotonic()
        self.tokens = 0

    def emit(self) -> None:
        """One `progress` milestone line plus a human line."""
        secs = max(time.monotonic() - self.started, 1e-9)
        tps = round(self.tokens / secs, 1)
        free = forecast.free_bytes(self.out_dir)
        low = forecast.disk_state(free, max(self.bytes_todo - self.bytes, 0), self.disk_low_bytes)
        extra: dict[str, Any] = {"free_bytes": free, "disk_low": low, "layer_rms": self.stats.take_recent()}
        if self.collapses:
            extra["layer_collapse"], self.collapses = self.collapses, []
        if self.tokens_todo and self.tokens / secs > 0:
            extra["eta_s"] = round(max(self.tokens_todo - self.tokens, 0) / (self.tokens / secs), 1)
        signals.emit(
            "progress",
            samples_done=self.done,
            samples_total=self.total,
            tokens_per_s=tps,
            files_written=self.files,
            bytes_written=self.bytes,
            **extra,
        )
        signals.say(f"{self.done}/{self.total} samples, {tps} tok/s, {self.files} files, {self.bytes} bytes")


class ResultsLane:
    """Runs each drain's result-taking in order: on one background thread when ``overlap``, else inline.

    Taking results in (checks reported, statistics, manifest, progress lines) between two batches would
    leave the engine idle; overlapped, a take runs while the driver waits in the next ``llm.generate``.
    At most one take is in flight: ``run`` and ``join`` wait for it first, so the driver reads what takes
    update only after a join; a take's error is raised there. ``waited_s`` is the driver's own time on takes.
    """

    def __init__(self, overlap: bool) -> None:
        self.waited_s = 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eaglewatch-results") if overlap else None
        self._pending: Future[None] | None = None

    def run(self, take: Callable[[], None], inline: bool = False) -> None:
        """Take one drain's results, behind the one in flight; ``inline``: done before returning."""
        self.join()
        if self._pool is None or inline:
            t0 = time.monotonic()
            try:
                take()
            finally:
                self.waited_s += time.monotonic() - t0
            return
        self._pending = self._pool.submit(take)

    def join(self) -> None:
        """Wait for the take in flight; its error is raised here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.monotonic()
        try:
            pending.result()
        finally:
            self.waited_s += time.monotonic() - t0

    def close(self) -> None:
        """Finish the take in flight (raising its error) and end the thread."""
        try:
            self.join()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def __enter__(self) -> ResultsLane:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        # The driver fails already: wait for the take so nothing writes after this, keep the driver's error.
        try:
            self.close()
        except Exception as also:
            signals.say(f"taking results in failed too: {type(also).__name__}: {also}")


def handle_results(results: list[dict[str, Any]], plan: Plan, manifest: Manifest, prog: Progress) -> None:
    """Emit check lines for finished samples, update counters and the manifest; raise on policy stop."""
    stop_reason = None
    per_file: list[tuple[int, list[dict[str, float]]]] = []  # layer_stats.jsonl lines, appended at once
    for r in sorted(results, key=lambda r: r["idx"]):
        prog.done += 1
        prog.tokens += r["tokens"]
        if r["written"]:
            prog.files += 1
            prog.bytes += r["bytes"]
            manifest.bytes_written += r["bytes"]
            manifest.sample_tokens[r["idx"]] = r["tokens"]
            if r.get("layer_stats"):
                found = prog.stats.add(r["layer_stats"])
                per_file.append((r["idx"], r["layer_stats"]))
                for f in found:
                    signals.say(f"layer_collapse: {r['file']}: {f['message']}")
                prog.collapses += [{**f, "file": r["file"]} for f in found]
        if r["problems"]:
            prog.failed_checks += 1
            for p in r["problems"]:
                signals.emit(
                    "shape_check_failed", file=r["file"], index=r["idx"], code=p["code"], message=p["message"]
                )
            if plan.spec.on_shape_failure == "stop" and stop_reason is None:
                stop_reason = f"{r['file']}: {r['problems'][0]['message']} (on_shape_failure=stop)"
        else:
            signals.emit("shape_check_passed", file=r["file"], index=r["idx"])
    stats.append_files(plan.spec.output_dir or ".", plan.layer_ids, per_file)
    manifest.layer_stats = prog.stats.to_manifest()
    manifest.save(plan.spec.output_dir or ".")
    if stop_reason:
        raise CaptureFailed(stop_reason)


def run_worker_extension(
    plan: Plan,
    todo: list[Sample],
    manifest: Manifest,
    prog: Progress,
    extension: str,
    overlap_results: bool,
) -> None:
    """Backend worker-extension: vLLM with our worker extension; the worker writes the files."""
    from vllm import LLM

    spec = plan.spec
    try:  # the workers read the same env: refuse a malformed knob before the engine takes minutes to start
        tune = tuning_from_env()
    except ValueError as e:
        raise CaptureFailed(str(e)) from None
    extra, capture = prepare_engine(plan)
    kwargs = engine_kwargs(str(plan.model_dir), [*spec.vllm_args, *extra])
    longest = max(len(s.token_ids) for s in todo)
    kwargs.setdefault("max_model_len", longest + 1)
    # prefix caching would skip the cached tokens' forward; hooks run only eager, aux outputs compiled too
    kwargs.update(enforce_eager=not capture.compiled, enable_prefix_caching=False)
    llm = LLM(
        model=str(plan.model_dir),
        worker_extension_cls=extension,
        tensor_parallel_size=spec.tensor_parallel_size,
        **kwargs,
    )
    cfg = {
        "layer_ids": plan.layer_ids,
        "convention": spec.layer_convention,
        "output_dir": spec.output_dir,
        "fault": spec.inject_fault,
        "stop_on_failure": spec.on_shape_failure == "stop",
        "capture": capture.path,
    }
    info = one_result(llm.collective_rpc("eaglewatch_setup", args=(cfg,)))
    manifest.dtype = info["dtype"]
    found = {k: info.get(k) for k in ("model_runner", "capture", "stats_kernel", "tuning")}
    configured(plan, info["dtype"], info["layer_class"], **found)
    try:
        capture_batches(llm, plan, todo, manifest, prog, overlap_results)
    finally:
        if tune.trace:  # a diagnostic: written once, after the last step, failed runs too
            llm.collective_rpc("eaglewatch_write_trace")


def capture_batches(
    llm: Any,
    plan: Plan,
    todo: list[Sample],
    manifest: Manifest,
    prog: Progress,
    overlap_results: bool,
) -> None:
    """Run the batches through the engine, collect their files, run the canary rounds.

    A batch's last writes overlap the next batch's steps; overlap_results: so does taking in a drain's
    results (False: between batches)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    spec = plan.spec
    prog.restart_clock()
    stop = spec.on_shape_failure == "stop"
    # under stop, results are taken at once, so that a bad sample stops the run before the next batch starts
    overlap = overlap_results and not stop
    outstanding: list[list[Sample]] = []
    seen: set[int] = set()
    first: list[Sample] | None = None  # the first batch, until its canary round has started
    starts = range(0, len(todo), spec.batch_size)
    with ResultsLane(overlap) as lane:
        for start in starts:
            batch = todo[start : start + spec.batch_size]
            prompts = [TokensPrompt(prompt_token_ids=list(s.token_ids)) for s in batch]
            params = [
                SamplingParams(max_tokens=1, temperature=0.0, extra_args={"eaglewatch_idx": s.idx})
                for s in batch
            ]
            t0 = time.monotonic()
            llm.generate(prompts, params, use_tqdm=False)
            prog.engine_s += time.monotonic() - t0
            lane.join()  # the previous drain's results are in before anything here reads them
            if overlap and first is not None and all(s.idx in seen for s in first):
                start_canary(llm, plan, first, manifest.dtype, "first batch", prog)
                first = None
            outstanding.append(batch)
            if start == starts[0]:
                first = batch
            # the canary compares with the first batch's files: it starts once they are all written; under
            # on_shape_failure=stop it is waited for, so a mismatch stops the run after the first batch
            wait = first is not None and stop
            collect(llm, plan, manifest, prog, (outstanding, seen, wait), lane)
            if not overlap and first is not None and all(s.idx in seen for s in first):
                start_canary(llm, plan, first, manifest.dtype, "first batch", prog)
                first = None
                if stop and prog.canaries:
                    collect(llm, plan, manifest, prog, (outstanding, seen, True), lane)
        collect(llm, plan, manifest, prog, (outstanding, seen, True), lane)
        if first is not None:
            start_canary(llm, plan, first, manifest.dtype, "first batch", prog)
        end = canary.end_batch(todo, spec.batch_size)
        if end is not None:
            start_canary(llm, plan, end, manifest.dtype, "end", prog)
        if prog.canaries:
            collect(llm, plan, manifest, prog, (outstanding, seen, True), lane)
    prog.results_wait_s = lane.waited_s
    if prog.canaries:
        late = ", ".join(r.when for r in prog.canaries)
        raise CaptureFailed(f"canary ({late}): its re-captures did not all come back")


def start_canary(llm: Any, plan: Plan, batch: list[Sample], dtype: str, when: str, prog: Progress) -> None:
    """Capture a few samples of a batch again, alone; collect() compares them with their batched files as
    the writer finishes them and then reports the round (canary_checked)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    chosen = canary.pick(batch, plan.spec.canary_samples)
    if len(batch) < 2 or not chosen:
        return  # a batch of one was captured alone already
    for s in chosen:  # one generate call each: nothing else is scheduled beside it
        extra = {"eaglewatch_idx": s.idx, canary.CANARY_KEY: True}
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
        llm.generate([TokensPrompt(prompt_token_ids=list(s.token_ids))], [params], use_tqdm=False)
    prog.canaries.append(CanaryRound(when, len(chosen), dtype))


def report_canary(plan: Plan, diffs: list[float | None], dtype: str, when: str) -> None:
    """The canary_checked milestone of one round; raises CaptureFailed on a mismatch under stop."""
    result = canary.verdict(diffs, dtype)
    signals.emit("canary_checked", when=when, **result)
    if result["ok"]:
        return
    message = (
        f"canary ({when}): samples captured alone differ from their batched capture by up to "
        f"{result['max_rel_diff']:.3g} (median token's relative L2, tolerance {result['tolerance']} "
        f"for {dtype})"
    )
    signals.say(message)
    if plan.spec.on_shape_failure == "stop":
        raise CaptureFailed(f"{message} (on_shape_failure=stop)")


def collect(
    llm: Any,
    plan: Plan,
    manifest: Manifest,
    prog: Progress,
    batches: tuple[list[list[Sample]], set[int], bool],
    lane: ResultsLane,
) -> None:
    """Drain the writer's finished samples (waiting for all when ``batches``' flag says so), then take them
    in on ``lane``: a waiting drain's at once, since the caller reads them next."""
    wait = batches[2]
    t0 = time.monotonic()
    drained = one_result(llm.collective_rpc("eaglewatch_drain", args=(wait,)))
    prog.drain_s += time.monotonic() - t0
    lane.run(lambda: take_drained(drained, plan, manifest, prog, batches), inline=wait)


def take_drained(
    drained: dict[str, Any],
    plan: Plan,
    manifest: Manifest,
    prog: Progress,
    batches: tuple[list[list[Sample]], set[int], bool],
) -> None:
    """Report one drain's results: canary rounds now complete, checks, manifest, and each batch (of
    collect's outstanding, seen, wait) whose files are all in."""
    t0 = time.monotonic()
    outstanding, seen, wait = batches
    prog.sp_gathers = int(drained.get("gathers", 0))
    prog.capture_costs = drained.get("costs") or prog.capture_costs
    results = []
    for r in drained["results"]:
        if "error" in r:
            raise CaptureFailed(f"capture writer failed: {r['error']}")
        if not r.get("canary"):
            results.append(r)
            continue
        open_rounds = [c for c in prog.canaries if len(c.diffs) < c.expected]  # the oldest fills first
        if open_rounds:
            open_rounds[0].diffs.append(r.get("rel_diff"))
    while prog.canaries and len(prog.canaries[0].diffs) >= prog.canaries[0].expected:
        done = prog.canaries.pop(0)
        report_canary(plan, done.diffs, done.dtype, done.when)
    seen.update(r["idx"] for r in results)
    handle_results(results, plan, manifest, prog)
    complete = []
    while outstanding and all(s.idx in seen for s in outstanding[0]):
        complete.append(outstanding.pop(0))
    batches_done(complete, prog)
    prog.results_s += time.monotonic() - t0  # a failed take fails the run: its time is never reported
    if wait and outstanding:
        missing = [s.idx for b in outstanding for s in b if s.idx not in seen]
        raise CaptureFailed(f"no capture came back for samples {missing}")


def configured(
    plan: Plan,
    dtype: str,
    layer_class: str,
    model_runner: str | None = None,
    capture: str | None = None,
    stats_kernel: str | None = None,
    tuning: dict[str, Any] | None = None,
) -> None:
    """The capture_configured milestone: the runner, capture path, statistics kernel and tuning knobs the
    worker chose."""
    spec = plan.spec
    extra: dict[str, Any] = {"stats_kernel": stats_kernel} if stats_kernel else {}
    if tuning:
        extra["tuning"] = tuning
    signals.emit(
        "capture_configured",
        layers=plan.layer_ids,
        convention=spec.layer_convention,
        hidden_size=plan.hidden_size,
        dtype=dtype,
        backend=spec.backend,
        layer_class=layer_class,
        model_runner=model_runner,
        tensor_parallel_size=spec.tensor_parallel_size,
        capture=capture,
        **extra,
    )
    runner = f", model runner {model_runner}" if model_runner else ""
    signals.say(
        f"capturing layers {plan.layer_ids} ({spec.layer_convention} convention) of {layer_class}, "
        f"hidden {plan.hidden_size}, {dtype}, backend {spec.backend}{runner}, TP={spec.tensor_parallel_size}"
    )


def batches_done(batches: list[list[Sample]], prog: Progress) -> None:
    """A batch_captured line for each batch whose files are all written, then one progress line for them.

    One drain can complete several batches; the counters and per-layer RMS already cover all of them, so a
    progress line each would repeat the counts with the RMS of none."""
    for batch in batches:
        prog.batches += 1
        tokens = sum(len(s.token_ids) for s in batch)
        signals.emit("batch_captured", batch=prog.batches, samples=len(batch), tokens=tokens)
    if batches:
        prog.emit()
