"""GPU phase `overhead` (imported by run_gpu.py on the H200): capture cost on a Llama-3.1-8B-shaped model,
and a real extraction launched and stopped through the agent daemon.

The 8B model has its real config and random weights from vLLM's dummy loader (`--load-format dummy`), so
nothing is downloaded or written; plain vLLM prefill and the capture run the same prompts in the same
batches, each in a fresh engine process, one after another on an otherwise idle GPU.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPTS, TOKENS, BATCH = 512, 1024, 64
#: mode long: twice the prompts (34 GB written), so the run's fixed costs (the canary rounds, the last
#: batch's writes) weigh half as much as in the 12-second runs
LONG_PROMPTS = 1024
ARGS = ["--load-format", "dummy", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.85"]
PLAIN = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, data, eager, batch = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
rows = [json.loads(x)["token_ids"] for x in open(data)]
llm = LLM(model=model, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.85,
          enable_prefix_caching=False, max_model_len=len(rows[0]) + 1, enforce_eager=eager)
params = SamplingParams(max_tokens=1, temperature=0.0)
t0 = time.monotonic()
for i in range(0, len(rows), batch):
    llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows[i:i + batch]], params, use_tqdm=False)
secs = time.monotonic() - t0
print("PLAIN " + json.dumps({"tokens_per_s": sum(map(len, rows)) / secs, "seconds": secs}), flush=True)
"""


def model_dir(work: Path) -> Path:
    """config.json of Llama-3.1-8B's shape plus a small tokenizer (ids are given, never tokenised)."""
    from agent.extract.tinymodel import build

    out = work / "llama-8b"
    if not (out / "config.json").exists():
        tiny = build(work / "llama-tok", "llama", seed=1)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tiny / name).exists():
                shutil.copy(tiny / name, out / name)
        (out / "config.json").write_text(json.dumps(LLAMA_8B, indent=1))
    return out


def plain(
    work: Path, data: Path, eager: bool, env: dict[str, str], logs: Path, round_: int = 1, tag: str = ""
) -> dict[str, float]:
    """Plain vLLM prefill (max_tokens=1) of the dataset, in batches like the job's: tokens_per_s, seconds."""
    log = logs / f"plain-8b-{'eager' if eager else 'graphs'}{tag}{f'-{round_}' if round_ > 1 else ''}.log"
    with log.open("w") as fh:
        subprocess.run(
            [sys.executable, "-c", PLAIN, str(model_dir(work)), str(data), "1" if eager else "0", str(BATCH)],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=400,
            check=False,
        )
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("PLAIN "):
            return {k: float(v) for k, v in json.loads(line[6:]).items()}
    raise RuntimeError(f"plain prefill failed; see {log.name}")


#: variants of the capture run: (tag, backend, CUDA graphs, extra env, output on /dev/shm)
FULL = [
    ("worker-extension", "worker-extension", False, {}, False),
    ("vllm-native", "vllm-native", True, {}, False),
]
#: CUDA graphs on: the capture reads vLLM's aux outputs (V1), twice
GRAPHS = [
    ("worker-extension-graphs", "worker-extension", True, {}, False),
    ("worker-extension-graphs-again", "worker-extension", True, {}, False),
]
#: the capture's tuning knobs (agent/extract/engine/setup.py) against the writer process as it ships, each
#: with a per-step trace of its costs in the logs
TUNE = [
    ("tune-process", "worker-extension", True, {}, False),
    (
        "tune-wide",
        "worker-extension",
        True,
        {"EAGLEWATCH_PINNED_BUFFERS": "10", "EAGLEWATCH_WRITERS": "8"},
        False,
    ),
]
#: after the statistics are warmed at setup: the writer process with 4 and 8 threads
WARM = [
    ("warm-process", "worker-extension", True, {}, False),
    ("warm-process-8", "worker-extension", True, {"EAGLEWATCH_WRITERS": "8"}, False),
]
#: the statistics warmed under inference mode, twice
CONFIRM = [
    ("confirm-process", "worker-extension", True, {}, False),
    ("confirm-process-again", "worker-extension", True, {}, False),
]
#: end to end as it ships (on CUDA: the writer process, each file's write-out started by a flusher thread as
#: it is written, agent/extract/writing/writeback.py, a drain's results taken in beside the next batch,
#: agent/extract/engine/driver.py) against results taken in between batches (ARGS: the job's own
#: options), twice each, alternating
E2E = [
    ("e2e-default", "worker-extension", True, {}, False),
    ("e2e-inline", "worker-extension", True, {"ARGS": "--results-between-batches"}, False),
    ("e2e-default-again", "worker-extension", True, {}, False),
    ("e2e-inline-again", "worker-extension", True, {"ARGS": "--results-between-batches"}, False),
]
#: the end-to-end variants of rounds M–N (write-out paced by the flusher thread, or left to the kernel)
E2E_KERNEL = [
    ("e2e-default", "worker-extension", True, {}, False),
    ("e2e-kernel", "worker-extension", True, {"EAGLEWATCH_WRITEBACK_MB": "0"}, False),
    ("e2e-default-again", "worker-extension", True, {}, False),
]
#: modes whose capture runs the V1 runner with graphs (the aux path): their plain baseline is V1 too
V1_PLAIN_MODES = ("long", "tune", "warm", "confirm", "e2e", "e2ekernel")
WRITER = [
    ("worker-extension", "worker-extension", False, {}, False),
    ("worker-extension-tmpfs", "worker-extension", False, {}, True),
]


def _meminfo_mb(*names: str) -> float:
    """The sum of /proc/meminfo's named fields, in MB."""
    got = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        got[key] = int(rest.split()[0]) if rest.split() else 0
    return sum(got.get(n, 0) for n in names) / 1024


class DirtyPeak:
    """Samples the host's dirty + writeback page cache every 50 ms while a job runs: its peak, in MB."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DirtyPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _meminfo_mb("Dirty", "Writeback"))


def host_disk(work: Path) -> str:
    """The kernel's dirty-page limits, available memory and the disk's direct write speed, for the note."""
    vm = {}
    for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes"):
        vm[name] = Path(f"/proc/sys/vm/{name}").read_text().strip()
    probe = work / "disk-probe"
    res = subprocess.run(
        ["dd", "if=/dev/zero", f"of={probe}", "bs=64M", "count=64", "oflag=direct"],
        capture_output=True,
        text=True,
        check=False,
    )
    probe.unlink(missing_ok=True)
    speed = (res.stderr.strip().splitlines() or ["dd: no output"])[-1]
    return f"vm {vm}, MemAvailable {_meminfo_mb('MemAvailable'):.0f} MB, 4 GiB direct write: {speed}"


def overhead(
    work: Path, logs: Path, version: str, env_for: Callable[..., dict[str, str]], mode: str = "full"
) -> list[dict[str, Any]]:
    """Plain prefill against capture runs on the 8B shape, same prompts and batches, one after another.

    mode full: plain eager and graphs, worker-extension, vllm-native, then the agent stop run; quick: plain
    eager and the worker extension; writer: plain eager and the worker extension writing to disk and into
    /dev/shm (no disk); graphs:
    plain with CUDA graphs against the capture with CUDA graphs (aux path), plain measured again mid-way;
    runners: plain with graphs under the V1 runner, then the graphs capture (V1) against it; long: plain V1
    with graphs and the graphs capture, on twice the prompts.
    """
    from tests.gpu.run_gpu import make_data, milestones, run_job

    prompts = LONG_PROMPTS if mode == "long" else PROMPTS
    data = work / f"8b-{prompts}.jsonl"
    make_data(data, [TOKENS] * prompts, 128000, 5)
    env = env_for({"CUDA_VISIBLE_DEVICES": "0"})
    if mode == "graphs":
        base = {"graphs": plain(work, data, False, env, logs)}
        base["eager"] = base["graphs"]
    elif mode in V1_PLAIN_MODES:
        base = {"graphs": plain(work, data, False, {**env, "VLLM_USE_V2_MODEL_RUNNER": "0"}, logs, tag="-v1")}
        base["eager"] = base["graphs"]
    elif (
        mode == "runners"
    ):  # the capture runs V1 with graphs: plain V2 (vLLM's default) and plain V1 beside it
        base = {"graphs": plain(work, data, False, env, logs)}
        v1 = plain(work, data, False, {**env, "VLLM_USE_V2_MODEL_RUNNER": "0"}, logs, tag="-v1")
        print(f"plain prefill, V2 runner: {base['graphs']}; V1 runner: {v1}", flush=True)
        base["eager"] = base["graphs"] = v1
    else:
        base = {"eager": plain(work, data, True, env, logs)}
        base["graphs"] = plain(work, data, False, env, logs) if mode == "full" else base["eager"]
    print(f"plain prefill: {base}", flush=True)
    disk = host_disk(work) if mode.startswith("e2e") else ""
    if disk:
        print(f"host: {disk}", flush=True)
    # quick: two rounds (plain, capture, plain, capture), so the record shows the run-to-run spread too
    variants = {
        "full": FULL,
        "quick": FULL[:1] * 2,
        "writer": WRITER,
        "graphs": GRAPHS,
        "runners": GRAPHS[:2],
        "long": GRAPHS[1:2],
        "tune": TUNE,
        "warm": WARM,
        "confirm": CONFIRM,
        "e2e": E2E,
        "e2ekernel": E2E_KERNEL,
    }[mode]
    records = []
    for n, (tag, backend, graphs, extra, tmpfs) in enumerate(variants):
        if (mode == "quick" and n) or (mode == "graphs" and n == 2):
            base["eager"] = base["graphs"] = plain(work, data, mode == "quick", env, logs, round_=n + 1)
            print(f"plain prefill again: {base['eager']}", flush=True)
        name = f"llama-8b-{tag}" + (f"-{n + 1}" if mode == "quick" and n else "")
        root = Path("/dev/shm/ew-out") if tmpfs else work / "out"
        free = shutil.disk_usage("/dev/shm").free
        if tmpfs and free < 20e9:
            print(f"{name}: skipped, /dev/shm has {free} bytes free", flush=True)
            continue
        out = root / name
        traced = mode in ("tune", "warm", "confirm") or extra.get("TRACE") == "1"
        trace = {"EAGLEWATCH_COSTS_TRACE": str(logs / f"{name}.trace.json")} if traced else {}
        spec = {
            "name": name,
            "backend": backend,
            "model": str(model_dir(work)),
            "dataset": str(data),
            "output_dir": str(out),
            "batch_size": BATCH,
            "vllm_args": ARGS + ([] if graphs else ["--enforce-eager"]),
            "env": {k: v for k, v in extra.items() if k not in ("TRACE", "ARGS")} | trace,
        }
        with DirtyPeak() as dirty:
            res = run_job(name, spec, {"CUDA_VISIBLE_DEVICES": "0"}, logs, extra.get("ARGS", "").split())
        prog = [e for e in res["events"] if e["kind"] == "progress"]
        done = next((e for e in res["events"] if e["kind"] == "completed"), {})
        conf = next((e for e in res["events"] if e["kind"] == "capture_configured"), {})
        engine = next((e for e in res["events"] if e["kind"] == "engine_config"), {})
        tps = float(prog[-1]["tokens_per_s"]) if prog and res["rc"] == 0 else None
        files = len(list(out.glob("hs_*.safetensors")))
        size = sum(p.stat().st_size for p in out.glob("hs_*.safetensors"))
        shutil.rmtree(out, ignore_errors=True)  # 17 GB each: the disk must hold the next run
        same = base["graphs" if graphs else "eager"]
        engine_s = done.get("engine_seconds")
        step_ratio = round(same["seconds"] / engine_s, 4) if engine_s else None
        ms = milestones(res["log"], 1)
        records.append(
            {
                "gpu": "H200",
                "gpus": 1,
                "tp": 1,
                "model": "llama-8b",
                "backend": backend,
                "vllm": version,
                "cuda_graphs": bool(engine.get("cuda_graphs")),
                "files": files,
                "max_rel_err": None,
                "tp1_max_abs_diff": None,
                "overhead_ratio": round(tps / same["tokens_per_s"], 4) if tps else None,
                "ok": res["rc"] == 0 and files == prompts,
                "note": (
                    f"{tag}: writer {conf.get('writer')}, capture path {conf.get('capture')}, "
                    f"tuning {conf.get('tuning')}, "
                    f"statistics {conf.get('stats_kernel')}; "
                    f"capture {tps} tok/s vs plain "
                    f"{'graphs' if graphs else 'eager'} {same['tokens_per_s']:.0f} tok/s; time in generate "
                    f"{engine_s} s vs plain {same['seconds']:.2f} s (per-step ratio {step_ratio}), waiting "
                    f"for writes after batches {done.get('drain_seconds')} s, taking results in "
                    f"{done.get('results_seconds')} s (the driver waited "
                    f"{done.get('results_wait_seconds')} s of it); "
                    f"peak dirty+writeback page cache {dirty.peak:.0f} MB; "
                    f"capture costs {done.get('capture_costs')}; "
                    f"{prompts} prompts x {TOKENS} tokens, batches of {BATCH}, {size / 1e9:.1f} GB "
                    f"written to {'/dev/shm' if tmpfs else 'disk'}; dummy weights, no HF reference; "
                    f"milestones {ms['kinds']}; {res['seconds']} s" + (f"; host: {disk}" if disk else "")
                ),
            }
        )
        print(json.dumps(records[-1]), flush=True)
    if mode == "full":
        records.append(agent_stop(work, data, version, env_for, logs))
        print(json.dumps(records[-1]), flush=True)
    return records


def _used_mib() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [int(x) for x in out.split()]


def _call(fh: Any, rid: int, op: str, **args: Any) -> dict[str, Any]:
    fh.write(json.dumps({"id": rid, "op": op, **args}).encode() + b"\n")
    fh.flush()
    while True:
        msg = json.loads(fh.readline())
        if msg.get("id") == rid and msg.get("type") in ("reply", "error"):
            return dict(msg)


def agent_stop(
    work: Path, data: Path, version: str, env_for: Callable[..., dict[str, str]], logs: Path
) -> dict[str, Any]:
    """Launch the 8B capture at TP=2 through the real daemon, watch its journal, stop it, check the GPUs."""
    state = work / "agent-state"
    shutil.rmtree(state, ignore_errors=True)
    baseline = _used_mib()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "agent", "daemon", "--state-dir", str(state)],
        cwd=ROOT,
        env=env_for(),
        stdout=subprocess.DEVNULL,
        stderr=(logs / "daemon.stderr").open("wb"),
        start_new_session=True,
    )
    note, ok, kinds, ranks, found = "", False, [], None, []
    try:
        for _ in range(100):
            if (state / "agent.sock").exists():
                break
            time.sleep(0.2)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(state / "agent.sock"))
        fh = sock.makefile("rwb")
        fh.readline()  # hello
        spec = {
            "name": "stop-8b",
            "host": "h200",
            "backend": "worker-extension",
            "model": str(model_dir(work)),
            "dataset": str(data),
            "output_dir": str(work / "out" / "stop-8b"),
            "tensor_parallel_size": 2,
            "batch_size": BATCH,
            "vllm_args": ARGS,
        }
        launched = _call(fh, 1, "launch", run="stop-8b", spec=spec)
        journal = state / "runs" / "stop-8b" / "events.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            events = [json.loads(x) for x in journal.read_text().splitlines()] if journal.exists() else []
            found = [e for e in events if e.get("type") == "milestone"]
            kinds = sorted({e.get("kind") for e in found if e.get("kind")})
            if "batch_captured" in kinds or "failed" in kinds:
                break
            time.sleep(1)
        injected = [e for e in found if e.get("kind") == "extension_injected"]
        ranks = (injected[0].get("fields") or {}).get("ranks") if injected else None
        held = _used_mib()
        stop = _call(fh, 2, "stop", run="stop-8b", grace_s=10)
        result = stop.get("result") or {}
        time.sleep(3)
        after = _used_mib()
        freed = all(a < b + 1024 for a, b in zip(after, baseline, strict=True))
        ok = bool(launched.get("ok")) and "batch_captured" in kinds and ranks == [0, 1]
        ok = ok and result.get("gpu_released") is True and freed and result.get("confirmed") is True
        note = (
            f"launched through the agent daemon; journal milestones {kinds}; injected ranks {ranks}; "
            f"stopped after the first batch: gpu_released={result.get('gpu_released')}, "
            f"confirmed={result.get('confirmed')}; nvidia-smi MiB used {baseline} at start, {held} while "
            f"running, {after} after stop"
        )
        _call(fh, 3, "shutdown")
    except Exception as e:  # the record says what broke; the phase goes on to write its files
        note = f"agent stop check broke: {type(e).__name__}: {e}; journal kinds {kinds}"
    finally:
        if daemon.poll() is None:
            daemon.kill()
        for f in (state / "runs" / "stop-8b").glob("*"):
            if f.is_file() and f.stat().st_size < 20 << 20:
                shutil.copy(f, logs / f"stop-8b-{f.name}")
        shutil.rmtree(work / "out" / "stop-8b", ignore_errors=True)
    return {
        "gpu": "H200",
        "gpus": 2,
        "tp": 2,
        "model": "llama-8b",
        "backend": "worker-extension",
        "vllm": version,
        "cuda_graphs": False,
        "files": None,
        "max_rel_err": None,
        "tp1_max_abs_diff": None,
        "overhead_ratio": None,
        "ok": ok,
        "note": note,
    }
