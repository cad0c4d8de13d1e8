"""Realistic vLLM logs written from vLLM's own format strings (docs/vllm.md; tests, bench).

``make_log(tp=8, failure="oom")`` returns the bytes a TP=8 vLLM run with the eaglewatch worker extension
would write to its log: process prefixes (``(Worker_TP3 pid=…)``, old ``(VllmWorkerProcess pid=…)``),
every worker line once per rank in a shuffled order, tqdm bars redrawn with ``\\r``, optional colour codes,
throughput lines, EAGLEWATCH marker lines and, with ``failure``, the lines of that failure (tracebacks
logged with a prefix and header on each line, the way vLLM's formatter prints them).

Run as a program it prints such a log line by line, with a delay, like a real job:
``python tests/helpers/vllm_log.py --tp 2 --failure oom --delay 0.01``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

FAILURES = (
    "oom",
    "nccl",
    "import",
    "api_mismatch",
    "rpc_timeout",
    "worker_died",
    "engine_failed",
    "shm_stall",
    "kv_cache",
    "killed",
    "segfault",
)
#: The error class the engine must report for each ``failure`` (the root cause).
FAILURE_CLASS = {f: f for f in FAILURES}
#: Formats: "new" = ``INFO 02-21 22:48:03 [file.py:12] msg`` + ``(Worker_TP3 pid=…)``; "old" =
#: ``INFO 02-21 22:48:03 file.py:12] msg`` + ``(VllmWorkerProcess pid=…)`` (rank 0 without prefix);
#: "rank" = old header + ``(VllmWorker rank=3 pid=…)``.
FORMATS = ("new", "old", "rank")

_GREEN, _YELLOW, _RED, _DIM, _RESET = "\x1b[32m", "\x1b[33m", "\x1b[31m", "\x1b[2m", "\x1b[0m"
_LEVEL_COLOUR = {"INFO": _GREEN, "WARNING": _YELLOW, "ERROR": _RED, "DEBUG": _DIM}
MODEL = "/models/Llama-3.1-8B-Instruct"


class LogWriter:
    """Formats vLLM log lines the way vllm/logger.py and the process-prefix wrapper do."""

    def __init__(self, tp: int, fmt: str = "new", colours: bool = False, seed: int = 0) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}")
        self.tp, self.fmt, self.colours = tp, fmt, colours
        self.rng = random.Random(seed)
        self.lines: list[str] = []
        self.second = 0

    def prefix(self, proc: str, rank: int | None = None) -> str:
        """The ``(name pid=N) `` process prefix; ``proc`` is api, engine or worker."""
        if proc == "api":
            return "(APIServer pid=1000) " if self.fmt == "new" else ""
        if proc == "engine":
            return "(EngineCore_DP0 pid=1100) " if self.fmt == "new" else ""
        assert rank is not None
        pid = 1200 + rank
        if self.fmt == "new":
            return f"(Worker_TP{rank} pid={pid}) " if self.tp > 1 else f"(Worker pid={pid}) "
        if self.fmt == "rank":
            return f"(VllmWorker rank={rank} pid={pid}) "
        return "" if rank == 0 else f"(VllmWorkerProcess pid={pid}) "

    def header(self, level: str, src: str) -> str:
        """``INFO 02-21 22:48:03 [file.py:12] `` (new) or ``INFO 02-21 22:48:03 file.py:12] `` (old)."""
        self.second += 1
        ts = f"02-21 22:{48 + self.second // 60 % 10:02d}:{self.second % 60:02d}"
        lvl = f"{_LEVEL_COLOUR[level]}{level}{_RESET}" if self.colours else level
        ts = f"{_DIM}{ts}{_RESET}" if self.colours else ts
        where = f"[{src}]" if self.fmt == "new" else f"{src}]"
        return f"{lvl} {ts} {where} "

    def log(self, proc: str, level: str, src: str, msg: str, rank: int | None = None) -> None:
        """One record; a multi-line message repeats prefix and header on each line (NewLineFormatter)."""
        head = self.prefix(proc, rank) + self.header(level, src)
        for part in msg.split("\n"):
            self.lines.append(head + part)

    def per_rank(self, level: str, src: str, fmt: str, *args_of_rank: object) -> None:
        """The same record printed by every worker, ranks in a shuffled order; ``{r}`` is the rank."""
        ranks = list(range(self.tp))
        self.rng.shuffle(ranks)
        for r in ranks:
            self.log("worker", level, src, fmt.format(r=r, tp=self.tp), rank=r)

    def interleave(self, blocks: list[list[str]]) -> None:
        """Append the blocks' lines mixed at random, each block keeping its own order."""
        queues = [list(b) for b in blocks if b]
        while queues:
            q = self.rng.choice(queues)
            self.lines.append(q.pop(0))
            if not q:
                queues.remove(q)

    def raw(self, text: str) -> None:
        """A line written straight to the stream (shell messages, tqdm, print())."""
        self.lines.append(text)

    def marker(self, kind: str, **fields: object) -> None:
        """An EAGLEWATCH machine-readable line of the extraction job."""
        self.lines.append("EAGLEWATCH " + json.dumps({"kind": kind, **fields}))


def traceback_text(exc_line: str, frames: list[tuple[str, int, str]]) -> str:
    """A Python traceback (multi-line) ending in ``exc_line``."""
    out = ["Traceback (most recent call last):"]
    for file, lineno, func in frames:
        out.append(f'  File "{file}", line {lineno}, in {func}')
        out.append(f"    {func}_call(self)")
    out.append(exc_line)
    return "\n".join(out)


_VLLM = "/usr/lib/python3/site-packages/vllm"
_WORKER_FRAMES = [
    (f"{_VLLM}/v1/executor/multiproc_executor.py", 571, "worker_main"),
    (f"{_VLLM}/v1/worker/gpu_worker.py", 273, "load_model"),
    (f"{_VLLM}/v1/worker/gpu_model_runner.py", 4735, "load_model"),
]
_EXC = {
    "oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU {r} has a total "
    "capacity of 79.19 GiB of which 1.06 GiB is free.",
    "nccl": "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
    "ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    "import": "ModuleNotFoundError: No module named 'speculators'",
    "api_mismatch": "AttributeError: 'Worker' object has no attribute 'model_runner'",
    "kv_cache": "ValueError: To serve at least one request with the models's max seq len (131072), "
    "(16.00 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (9.50 GiB). Based on the "
    "available memory, the estimated maximum model length is 77824.",
}


def _startup(w: LogWriter, stop_after: str | None) -> bool:
    """Engine start-up up to ``stop_after`` (a step name); False when it stopped early."""
    tp = w.tp
    w.log("api", "INFO", "utils.py:279", f"vLLM server version 0.19.1, serving model {MODEL}")
    w.log(
        "api",
        "INFO",
        "utils.py:233",
        f"non-default args: {{'model': '{MODEL}', 'tensor_parallel_size': {tp}}}",
    )
    w.log("api", "INFO", "model.py:549", "Resolved architecture: LlamaForCausalLM")
    w.log("api", "INFO", "model.py:1678", "Using max model len 4096")
    w.log(
        "engine",
        "INFO",
        "core.py:105",
        f"Initializing a V1 LLM engine (v0.19.1) with config: model='{MODEL}', "
        f"speculative_config=None, tokenizer='{MODEL}', tensor_parallel_size={tp}, dtype=torch.bfloat16",
    )
    if tp > 1:
        w.per_rank(
            "INFO",
            "parallel_state.py:1400",
            "world_size={tp} rank={r} local_rank={r} "
            "distributed_init_method=tcp://127.0.0.1:29500 backend=nccl",
        )
        w.per_rank("INFO", "pynccl.py:111", "vLLM is using nccl==2.27.3")
        if tp > 2:
            w.per_rank(
                "WARNING",
                "custom_all_reduce.py:154",
                "Custom allreduce is disabled because it's not "
                "supported on more than two PCIe-only GPUs. To silence this warning, specify "
                "disable_custom_all_reduce=True explicitly.",
            )
        w.per_rank(
            "INFO",
            "parallel_state.py:1716",
            "rank {r} in world size {tp} is assigned as DP rank 0, "
            "PP rank 0, PCP rank 0, TP rank {r}, EP rank {r}, EPLB rank N/A",
        )
    if stop_after == "distributed":
        return False
    w.per_rank(
        "INFO",
        "worker_base.py:269",
        "Injected <class 'speculators.data_generation.custom_worker."
        "HiddenStatesWorkerExtension'> into <class 'vllm.v1.worker.gpu_worker.Worker'> for extended "
        "collective_rpc calls ['_get_captured_states', '_reset_capture', '_setup_hidden_states_capture', "
        "'_store_captured_states']",
    )
    w.per_rank("INFO", "gpu_model_runner.py:4735", f"Starting to load model {MODEL}...")
    w.per_rank(
        "INFO",
        "cuda.py:334",
        "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLEX_ATTENTION'].",
    )
    if stop_after == "load_start":
        return False
    bar = "".join(
        f"{w.prefix('worker', 0)}Loading safetensors checkpoint shards: {100 * i // 4:3d}% Completed | {i}/4 "
        f"[00:0{i}<00:0{4 - i}, 1.02it/s]\r"
        for i in range(5)
    )
    w.raw(
        bar + f"{w.prefix('worker', 0)}Loading safetensors checkpoint shards: 100% Completed | 4/4 "
        "[00:04<00:00, 1.01it/s]"
    )
    w.per_rank("INFO", "default_loader.py:384", "Loading weights took 3.21 seconds")
    w.per_rank("INFO", "gpu_model_runner.py:4820", "Model loading took 15.2 GiB memory and 4.123456 seconds")
    w.per_rank("INFO", "backends.py:1111", "Dynamo bytecode transform time: 5.12 s")
    w.per_rank("INFO", "monitor.py:20", "torch.compile took 12.30 s in total")
    w.per_rank("INFO", "monitor.py:67", "Initial profiling/warmup run took 2.50 s")
    if stop_after == "profile":
        return False
    w.per_rank("INFO", "gpu_worker.py:436", "Available KV cache memory: 50.12 GiB")
    w.log("engine", "INFO", "kv_cache_utils.py:1319", "GPU KV cache size: 262,144 tokens")
    w.log(
        "engine", "INFO", "kv_cache_utils.py:1324", "Maximum concurrency for 4,096 tokens per request: 64.00x"
    )
    w.per_rank("INFO", "gpu_model_runner.py:6046", "Graph capturing finished in 12 secs, took 0.52 GiB")
    w.log(
        "engine",
        "INFO",
        "core.py:283",
        "init engine (profile, create kv cache, warmup model) took 45.67 seconds",
    )
    return True


def _failure(w: LogWriter, failure: str) -> None:
    """The lines a run that fails with ``failure`` prints (root cause first, then the fallout)."""
    if failure in _EXC:
        # Every rank fails at once: their tracebacks arrive interleaved line by line.
        blocks = []
        for r in range(w.tp):
            start = len(w.lines)
            exc = _EXC[failure].format(r=r)
            w.log("worker", "ERROR", "multiproc_executor.py:597", "WorkerProc failed to start.", rank=r)
            w.log("worker", "ERROR", "multiproc_executor.py:597", traceback_text(exc, _WORKER_FRAMES), rank=r)
            blocks.append(w.lines[start:])
            del w.lines[start:]
        w.interleave(blocks)
        w.log("engine", "ERROR", "core.py:708", "EngineCore failed to start.")
        w.log(
            "api",
            "ERROR",
            "core_client.py:512",
            "Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {'EngineCore_DP0': 1}",
        )
    elif failure == "rpc_timeout":
        w.log("engine", "ERROR", "multiproc_executor.py:260", "RPC call to _store_captured_states timed out.")
    elif failure == "worker_died":
        w.log(
            "engine",
            "ERROR",
            "multiproc_executor.py:150",
            "Worker proc VllmWorker-3 died unexpectedly (exit code: -9), shutting down executor.",
        )
    elif failure == "engine_failed":
        w.log(
            "api",
            "ERROR",
            "core_client.py:564",
            "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.",
        )
    elif failure == "shm_stall":
        w.log(
            "engine",
            "WARNING",
            "shm_broadcast.py:466",
            "No available shared memory broadcast block found in "
            "60 seconds. This typically happens when some processes are hanging or doing some "
            "time-consuming work (e.g. compilation, weight/kv cache quantization).",
        )
    elif failure == "killed":
        w.raw("Killed")
    elif failure == "segfault":
        w.raw("Fatal Python error: Segmentation fault")
    else:
        raise ValueError(f"unknown failure {failure!r} (known: {', '.join(FAILURES)})")


#: Where each failure strikes: the start-up step it interrupts (None: after the engine is ready).
_STOP = {
    "oom": "load_start",
    "nccl": "distributed",
    "import": "distributed",
    "api_mismatch": "load_start",
    "kv_cache": "profile",
}


def throughput_line(w: LogWriter, i: int) -> None:
    """One periodic stats line of vllm/v1/metrics/loggers.py."""
    w.log(
        "api",
        "INFO",
        "loggers.py:220",
        f"Engine 000: Avg prompt throughput: {1000 + i:.1f} tokens/s, Avg "
        f"generation throughput: {1.5 + i:.1f} tokens/s, Running: {8 + i % 4} reqs, Waiting: {i % 3} reqs, "
        f"GPU KV cache usage: {12.5 + i % 10:.1f}%, Prefix cache hit rate: 0.0%",
    )


def make_log(
    tp: int = 8,
    failure: str | None = None,
    colours: bool = False,
    fmt: str = "new",
    steps: int = 3,
    seed: int = 0,
) -> bytes:
    """The whole log of one run as bytes (``\\n``-terminated lines; tqdm bars redrawn with ``\\r``)."""
    if failure is not None and failure not in FAILURES:
        raise ValueError(f"unknown failure {failure!r} (known: {', '.join(FAILURES)})")
    w = LogWriter(tp, fmt=fmt, colours=colours, seed=seed)
    ready = _startup(w, _STOP.get(failure or ""))
    if ready:
        w.marker(
            "capture_configured", layers=[2, 16, 29, 32], output_dir="/data/hs", backend="worker-extension"
        )
        for i in range(steps):
            throughput_line(w, i)
            w.marker(
                "progress",
                samples_done=(i + 1) * 8,
                samples_total=steps * 8,
                tokens_per_s=1234.5,
                files_written=i + 1,
                bytes_written=(i + 1) * 1048576,
            )
    if failure is not None:
        _failure(w, failure)
    else:
        w.marker("completed", samples=steps * 8, files=steps)
    return ("\n".join(w.lines) + "\n").encode()


def steady_lines(n: int, tp: int = 8, seed: int = 0) -> list[str]:
    """``n`` lines of a run in steady state (what dominates a long log): debug chatter, stats, markers."""
    w = LogWriter(tp, seed=seed)
    i = 0
    while len(w.lines) < n:
        for r in range(tp):
            w.log(
                "worker",
                "DEBUG",
                "gpu_model_runner.py:2210",
                f"Captured hidden states for batch {i}: {8 * 512} tokens, 4 layers, hidden size 4096",
                rank=r,
            )
        w.log("engine", "DEBUG", "scheduler.py:601", f"Scheduled {8} requests, {4096} tokens, step {i}")
        w.log(
            "api",
            "INFO",
            "logger.py:41",
            f"Received request req-{i}: prompt: 'Write a haiku about {i}', "
            "params: SamplingParams(n=1, temperature=0.0, max_tokens=1)",
        )
        w.log("api", "INFO", "logger.py:77", f"Added request req-{i}.")
        if i % 10 == 0:
            throughput_line(w, i)
            w.marker(
                "progress",
                samples_done=i * 8,
                samples_total=10**9,
                tokens_per_s=1234.5,
                files_written=i,
                bytes_written=i * 1048576,
            )
        i += 1
    return w.lines[:n]


def main(argv: list[str] | None = None) -> int:
    """Print a log line by line (a stand-in for a vLLM job in daemon tests)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--failure", choices=FAILURES)
    p.add_argument("--fmt", choices=FORMATS, default="new")
    p.add_argument("--colours", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--delay", type=float, default=0.0, help="seconds between lines")
    p.add_argument("--exit-code", type=int, help="exit status (default 1 with --failure, else 0)")
    a = p.parse_args(argv)
    data = make_log(tp=a.tp, failure=a.failure, colours=a.colours, fmt=a.fmt, steps=a.steps)
    out = sys.stdout.buffer
    for chunk in data.splitlines(keepends=True):
        out.write(chunk)
        out.flush()
        if a.delay:
            time.sleep(a.delay)
    if a.exit_code is not None:
        return a.exit_code
    return 1 if a.failure else 0


if __name__ == "__main__":
    sys.exit(main())
