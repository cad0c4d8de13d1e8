"""vLLM worker extension: hooks the decoder layers; writes hidden states per request from the worker.

vLLM appends the class to the worker's bases (`worker_extension_cls`), so its methods are reachable with
`collective_rpc("eaglewatch_...")`; tensors never cross that boundary. How tokens are attributed and the two
capture paths (hooks, aux): docs/extraction.md. The V2 runner builds a fresh `InputBatch` per step in
`prepare_inputs`, sorted its own way, so its batch order is read there.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import torch
from torch import nn

from agent import settings
from agent.extract.capture import aux_capture
from agent.extract.capture.assembly import SinkConfig, spans_for_step
from agent.extract.capture.costs import StepCost
from agent.extract.capture.gpu_copy import PinnedCopier
from agent.extract.capture.stats import StepStats, fused_step_stats, step_stats, warm, warm_sizes
from agent.extract.engine.canary import CANARY_KEY
from agent.extract.engine.setup import tuning_from_env
from agent.extract.writing.writer_proc import ProcessSink

IDX_KEY = "eaglewatch_idx"


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The text decoder's layer list: a ModuleList of *DecoderLayer (VL shells and MTP heads skipped)."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == num_layers and len(mod) > 0:
            cls = type(mod[0]).__name__
            if "DecoderLayer" in cls and "vision" not in name and "mtp" not in name:
                found.append((name, mod))
    if not found:
        raise RuntimeError(f"no decoder layer list of {num_layers} layers found in {type(model).__name__}")
    return min(found, key=lambda x: len(x[0]))  # the outermost, e.g. model.layers over anything nested


def plan_hooks(layer_ids: list[int], convention: str, n: int) -> list[tuple[int, str, int]]:
    """(layer index, 'pre'|'post', slot) per requested id; input id N is the output of the last layer."""
    plan = []
    for slot, k in enumerate(layer_ids):
        aux_capture.aux_index(k, convention, n)  # the range check
        if convention == "input":
            plan.append((k, "pre", slot) if k < n else (n - 1, "post", slot))
        else:
            plan.append((k, "post", slot))
    return plan


def runner_kind(runner: Any) -> str:
    """'v1' or 'v2' by what the model runner exposes for token attribution; RuntimeError if neither."""
    if hasattr(runner, "input_batch") and hasattr(runner.input_batch, "req_ids"):
        return "v1"
    if callable(getattr(runner, "prepare_inputs", None)) and hasattr(runner, "req_states"):
        if getattr(runner, "pcp_manager", None) is not None:
            raise RuntimeError("prefill context parallelism splits a step's tokens across ranks: unsupported")
        return "v2"
    raise RuntimeError(
        f"{type(runner).__module__}.{type(runner).__name__} has neither a V1 input_batch nor a V2 "
        "prepare_inputs: this vLLM model runner is unsupported (set VLLM_USE_V2_MODEL_RUNNER=0 to try V1)"
    )


class _Step:
    """One scheduler step in flight: its output, request start positions, captured slots, batch order, and
    its launched capture (host rows, flags, stats, done event, release, timing) once all slots are in."""

    __slots__ = ("caps", "cost", "launched", "order", "so", "starts")

    def __init__(self, so: Any, starts: dict[str, int], nslots: int) -> None:
        self.so = so
        self.starts = starts
        self.caps: list[torch.Tensor | None] = [None] * nslots
        self.order: list[str] | None = None
        self.launched: tuple[Any, ...] | None = None
        self.cost = StepCost()


class EagleWatchCapture:
    """Mixin added to vLLM's worker class; public methods are RPC entry points (prefixed: no clashes)."""

    def _ew_init(self, kind: str, nslots: int, sink: ProcessSink | None) -> None:
        """Per-worker capture state; only TP rank 0 holds a sink (one writer)."""
        self._ew_rank0 = sink is not None
        self._ew_sink = sink
        self._ew_runner = kind
        self._ew_nslots = nslots
        self._ew_gathers = 0  # steps whose states came sequence-parallel sharded and were all-gathered
        self._ew_active: _Step | None = None  # the step being run; None outside real steps
        self._ew_copier: PinnedCopier | None = None
        self._ew_aux_slots: list[int] = []  # aux path: per slot, its position in the model's aux list
        self._ew_stats: StepStats = step_stats
        self._ew_stats_how = "eager"
        self._ew_tuning = tuning_from_env({})
        self._ew_warm_ms: dict[int, float] = {}  # compiled statistics warmed at setup: ms per token count

    def eaglewatch_setup(self, cfg: dict[str, Any]) -> dict[str, Any] | None:
        """Install the hooks; cfg: layer_ids, convention, output_dir, fault, stop_on_failure."""
        from vllm.distributed import parallel_state as ps

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        kind = runner_kind(runner)
        if ps.get_pp_group().world_size > 1:
            raise RuntimeError("pipeline parallelism is not supported by the worker-extension backend")
        model = runner.get_model()
        text_cfg = self.vllm_config.model_config.hf_text_config  # type: ignore[attr-defined]
        n = int(text_cfg.num_hidden_layers)
        path, layers = find_decoder_layers(model, n)
        tp_rank = ps.get_tp_group().rank_in_group
        hidden = int(text_cfg.hidden_size)
        device = torch.device(getattr(runner, "device", torch.device("cpu")))
        tune = tuning_from_env()
        sink_cfg = SinkConfig(
            cfg["output_dir"],
            len(cfg["layer_ids"]),
            hidden,
            fault=cfg.get("fault"),
            stop_on_failure=bool(cfg.get("stop_on_failure")),
            writers=tune.writers,
            writeback_mb=tune.writeback_mb,
        )
        sink = None
        if tp_rank == 0:
            sink = ProcessSink(sink_cfg, pin=device.type == "cuda", max_buffers=tune.pinned_buffers)
        self._ew_init(kind, len(cfg["layer_ids"]), sink)
        self._ew_tuning = tune
        if sink is not None and device.type == "cuda":
            self._ew_copier = PinnedCopier(device, tune.pinned_buffers, alloc=sink.alloc, free=sink.free)
            sched = self.vllm_config.scheduler_config  # type: ignore[attr-defined]
            elt = torch.empty((), dtype=self.vllm_config.model_config.dtype).element_size()  # type: ignore[attr-defined]
            nl = len(cfg["layer_ids"])
            # per token: the states, token_flags (2 bools) and token_stats ([L, 4] float32); 3 × 64 alignment
            step_bytes = int(sched.max_num_batched_tokens) * (nl * hidden * elt + 2 + 16 * nl) + 192
            self._ew_copier.reserve(step_bytes)
        if self._ew_rank0:  # compiled on CUDA only; the reason says so elsewhere
            dtype = self.vllm_config.model_config.dtype  # type: ignore[attr-defined]
            sample = torch.randn((16, len(cfg["layer_ids"]), hidden), dtype=dtype, device=device)
            self._ew_stats, self._ew_stats_how = fused_step_stats(sample)
            if self._ew_stats_how == "compiled":
                max_tokens = int(self.vllm_config.scheduler_config.max_num_batched_tokens)  # type: ignore[attr-defined]
                self._ew_warm_ms = warm(self._ew_stats, sample, warm_sizes(max_tokens))
        capture = cfg.get("capture") or "hooks"
        if capture == "aux":
            if kind != "v1":
                raise RuntimeError("the aux capture path reads the V1 model runner; this engine runs V2")
            if not getattr(runner, "use_aux_hidden_state_outputs", False):  # aux_capture.enable, at load
                raise RuntimeError(
                    "the engine started without aux hidden-state outputs: "
                    f"{settings.AUX_LAYERS.name} must be set before it starts"
                )
            self._ew_aux_slots = aux_capture.aux_plan(cfg["layer_ids"], cfg["convention"], n)[1]
            self._ew_wrap_forward(runner)
        else:
            for li, where, slot in plan_hooks(cfg["layer_ids"], cfg["convention"], n):
                if where == "pre":
                    layers[li].register_forward_pre_hook(
                        functools.partial(self._ew_pre, slot), with_kwargs=True
                    )
                else:
                    layers[li].register_forward_hook(functools.partial(self._ew_post, slot))
        self._ew_wrap_runner(runner, kind)
        if sink is None:
            return None
        started_s = sink.wait_ready()
        return {
            "rank": tp_rank,
            "layers_path": path,
            "layer_class": type(layers[0]).__name__,
            "num_hidden_layers": n,
            "hidden_size": hidden,
            "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),  # type: ignore[attr-defined]
            "device": str(device),
            "capture": capture,
            "stats_kernel": self._ew_stats_how,
            "tuning": {
                **tune.fields(),
                **({"stats_warm_ms": self._ew_warm_ms} if self._ew_warm_ms else {}),
                "writer_start_s": round(started_s, 3),
            },
            "model_runner": kind,
            "runner_class": f"{type(runner).__module__}.{type(runner).__name__}",
        }

    def _ew_wrap_runner(self, runner: Any, kind: str) -> None:
        """Bracket each execute_model call as one step; on V2, read the batch order prepare_inputs made."""
        orig = runner.execute_model

        @functools.wraps(orig)
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._ew_begin(scheduler_output)
            try:
                return orig(scheduler_output, *args, **kwargs)
            finally:
                self._ew_end()

        runner.execute_model = execute_model
        if kind != "v2":
            return
        prepare = runner.prepare_inputs

        @functools.wraps(prepare)
        def prepare_inputs(*args: Any, **kwargs: Any) -> Any:
            batch = prepare(*args, **kwargs)
            if self._ew_active is not None:
                self._ew_active.order = list(batch.req_ids)
            return batch

        runner.prepare_inputs = prepare_inputs

    def _ew_wrap_forward(self, runner: Any) -> None:
        """Aux path: read the states from each forward's (hidden, aux) output, outside the compiled graph."""
        orig = runner._model_forward
        count = len(set(self._ew_aux_slots))

        @functools.wraps(orig)
        def _model_forward(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            if self._ew_active is not None:
                aux = aux_capture.split_output(out, count)
                for slot, pos in enumerate(self._ew_aux_slots):
                    # graph outputs live in static buffers: _ew_end copies them before the next replay
                    self._ew_record(slot, aux[pos], None, copy=False)
            return out

        runner._model_forward = _model_forward

    def eaglewatch_drain(self, wait: bool = True) -> dict[str, Any] | None:
        """Finished samples (small dicts) and the capture's costs; wait: for all submitted. Rank 0 only."""
        if self._ew_sink is None:
            return None
        results = self._ew_sink.drain(wait)
        return {"results": results, "costs": self._ew_sink.cost_fields(), "gathers": self._ew_gathers}

    def eaglewatch_write_trace(self) -> str | None:
        """Write the per-step costs trace where settings.COSTS_TRACE says (rank 0); the path, or None.

        Once, after the last step: rewritten at every drain, its truncate would wait behind the writeback."""
        path = self._ew_tuning.trace
        if self._ew_sink is None or not path:
            return None
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(self._ew_sink.costs.trace(), fh)
        os.replace(tmp, path)
        return path

    # -- per step -------------------------------------------------------------------------------------
    def _ew_begin(self, so: Any) -> None:
        t0 = time.perf_counter()
        self._ew_active = None
        if so.total_num_scheduled_tokens <= 0:
            return
        starts: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            starts[new.req_id] = new.num_computed_tokens
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            if self._ew_sink is not None and IDX_KEY in extra and new.prompt_token_ids is not None:
                canary = bool(extra.get(CANARY_KEY))
                self._ew_sink.register(new.req_id, int(extra[IDX_KEY]), list(new.prompt_token_ids), canary)
        cached = so.scheduled_cached_reqs
        for rid, done in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            starts[rid] = done
        self._ew_active = _Step(so, starts, self._ew_nslots)
        self._ew_active.cost.begin_ms = 1000 * (time.perf_counter() - t0)

    def _ew_record(
        self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None, copy: bool = True
    ) -> None:
        step = self._ew_active
        if step is None:
            return  # dummy / profile runs
        total = step.so.total_num_scheduled_tokens
        if step.order is None and self._ew_runner == "v1":  # the batch order is final once the forward runs
            step.order = [r for r in self.model_runner.input_batch.req_ids if r is not None]  # type: ignore[attr-defined]
        # hooks: a copy, later norms work in place; aux: stacked (so copied) at the step's end
        state = hidden + residual if residual is not None else hidden.clone() if copy else hidden
        if state.shape[0] < total:  # sequence-parallel shard: every rank must join the gather
            from vllm.distributed import tensor_model_parallel_all_gather

            state = tensor_model_parallel_all_gather(state, 0)
            self._ew_gathers += 1
        if self._ew_rank0:
            step.caps[slot] = state[:total]
            if step.launched is None and all(c is not None for c in step.caps):
                self._ew_launch(step)

    def _ew_pre(self, slot: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
        residual = args[2] if len(args) > 2 else kwargs.get("residual")
        self._ew_record(slot, hidden, residual)

    def _ew_post(self, slot: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._ew_record(slot, output[0], output[1])  # (hidden_states, residual)

    def _ew_launch(self, step: _Step) -> None:
        """Queue the step's stack, statistics and device->host copy right behind its forward.

        Called as the last slot is recorded, while the host is still ahead of the GPU: launched at the end
        of execute_model instead (after the runner has waited for the sampled tokens), this host work would
        hold the GPU idle between steps.
        """
        t0 = time.perf_counter()
        assert self._ew_sink is not None
        copier = self._ew_copier
        start = None
        if copier is not None:
            # True when the GPU has run everything queued: it is waiting for this thread, not ahead of it
            step.cost.gpu_idle = torch.cuda.current_stream().query()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        rows = torch.stack(step.caps, dim=1)  # type: ignore[arg-type]  # [tokens, L, H] on the model's device
        # per-token layer sums for layer_stats and the finite / non-zero flags, computed where the data is
        stats, flags = self._ew_stats(rows)
        if copier is not None and start is not None:
            waited = copier.waited_s
            (host, host_flags, host_stats), event, release, (ready, began, done) = copier.copy_async(
                rows, flags, stats
            )
            step.launched = (host, host_flags, host_stats, event, release, (start, ready, began, done))
            step.cost.wait_ms = 1000 * (copier.waited_s - waited)
        else:
            step.launched = (rows, flags, stats, None, None, None)
        step.cost.launch_ms = 1000 * (time.perf_counter() - t0)

    def _ew_end(self) -> None:
        step, self._ew_active = self._ew_active, None
        if step is None or self._ew_sink is None:
            return
        if step.order is None or step.launched is None:
            return  # no forward ran in this step (e.g. an empty or failed step)
        t0 = time.perf_counter()
        spans = spans_for_step(step.order, dict(step.so.num_scheduled_tokens), step.starts)
        host, flags, stats, event, release, timing = step.launched
        costs = self._ew_sink.costs
        sent = time.perf_counter()

        def timed() -> None:
            costs.add_held(1000 * (time.perf_counter() - sent))  # how long the writer held the buffer
            release()

        self._ew_sink.submit(
            host, spans, event, timed if release is not None else None, flags, stats, timing=timing
        )
        step.cost.end_ms = 1000 * (time.perf_counter() - t0)
        step.cost.tokens = int(step.so.total_num_scheduled_tokens)
        costs.add_step(step.cost)


if settings.AUX_LAYERS.get() is not None:  # the job asked for aux outputs: workers import this before loading
    aux_capture.install()
