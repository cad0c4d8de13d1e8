"""The GPU validation, run ON a lent H200 machine (device tool) after tests/gpu/install_wheelhouse.sh.

`python3 tests/gpu/run_gpu.py PHASE --out DIR` with PHASE one of:
- `smoke`: one tiny-Llama worker-extension run at TP=1 under vLLM's default runner (a quick go/no-go);
- `correctness`: tiny Llama and tiny DeepSeek-V3 (MLA, kv_lora_rank 512), both backends, TP=1 and TP=2,
  CUDA graphs on and off where the backend allows, each compared with an HF-transformers reference (fp32 on
  the CPU, from the same checkpoint) and TP=2 with TP=1; the agent's rules read every real GPU log;
- `current`: `correctness` plus the worker extension with CUDA graphs on (its shipped default), and at TP=2
  the dense-routing DeepSeek-V3 against its TP=1 run; on a one-GPU machine the TP=2 cases are left out
  (printed, not recorded);
- `versions`: four TP=1 cases (both backends, graphs on and off) for another vLLM release, installed by
  install_wheelhouse.sh into its own GPUWH_SITE;
- `overhead`: a Llama-3.1-8B-shaped model (random weights, vLLM's dummy loader): plain vLLM prefill against
  the capture, same prompts, same batches; then a run launched and stopped through the agent daemon.
Writes DIR/validation.json (one record per run, the fields tests/gpu/validation.md describes) and
DIR/logs.tar.gz. Every process gets the machine's NVLink-multicast-off variables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
BASE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # flashinfer is not in the wheelhouse
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}
TINY_LAYERS = [2, 4, 5, 8]
GPU_MLA_DIMS = {"qk_nope_head_dim": 128, "v_head_dim": 128}
BF16_TOL = 3e-2  # bf16 keeps 8 mantissa bits; 8 layers of bf16 matmuls against an fp32 reference
WORK = Path("/tmp/ew-gpu")


def env_for(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every job and engine gets here."""
    env = {**os.environ, **BASE_ENV}
    site = os.environ.get("GPUWH_SITE", "/tmp/site")  # install_wheelhouse.sh's; another vLLM lives elsewhere
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def vllm_version() -> str:
    """The installed vLLM's version."""
    out = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"],
        env=env_for(),
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or f"import failed: {out.stderr[-500:]}"


def gpu_count() -> int:
    """The GPUs this machine shows (nvidia-smi), at least 1."""
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))


def make_data(path: Path, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """A JSONL dataset of token-id samples with the given lengths."""
    rng = random.Random(seed)
    samples = [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]
    path.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in samples))
    return samples


def run_job(
    name: str, spec: dict[str, Any], extra_env: dict[str, str], logs: Path, args: list[str] | None = None
) -> dict[str, Any]:
    """`python -m agent extract --spec [args]` as the agent would start it; events, rc and seconds."""
    spec_path = WORK / f"{name}.json"
    spec_path.write_text(json.dumps({"host": "h200", **spec}))
    log = logs / f"{name}.log"
    t0 = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "extract", "--spec", str(spec_path), *(args or [])],
            cwd=ROOT,
            env=env_for(extra_env),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            fh.write("\n[run_gpu] timed out after 300 s: killed\n")
            rc = -9
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # engine core and workers share the job's session
        proc.wait()
    text = log.read_text(errors="replace")
    events = [json.loads(x.split("EAGLEWATCH ", 1)[1]) for x in text.splitlines() if "EAGLEWATCH {" in x]
    return {"rc": rc, "events": events, "seconds": round(time.monotonic() - t0, 1), "log": log}


def milestones(log: Path, tp: int) -> dict[str, Any]:
    """What the agent's own rules read in a real GPU log: kinds seen and the injection's ranks."""
    out = subprocess.run(
        [sys.executable, "-m", "agent", "milestones", str(log), "--tp", str(tp), "--json"],
        cwd=ROOT,
        env=env_for(),
        capture_output=True,
        text=True,
        check=False,
    )
    found = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    kinds = sorted({m["kind"] for m in found})
    injected = [m["fields"].get("ranks") for m in found if m["kind"] == "extension_injected"]
    errors = [m["fields"].get("class") for m in found if m["kind"] == "error"]
    return {"kinds": kinds, "injected": injected, "errors": errors}


def load_files(out: Path) -> dict[int, dict[str, Any]]:
    """hs_{i}.safetensors of an output dir, by index."""
    from safetensors.torch import load_file

    return {int(p.stem.split("_")[1]): load_file(str(p)) for p in out.glob("hs_*.safetensors")}


def rel_err(got: Any, want: Any) -> float:
    """max |got - want| / max |want|, in float32."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def compare(files: dict[int, Any], ref: list[Any], samples: list[list[int]]) -> float:
    """The worst per-layer relative error of captured files against the HF reference; inf if any is off."""
    worst = 0.0
    for i, ids in enumerate(samples):
        f = files.get(i)
        if (
            f is None
            or f["token_ids"].tolist() != ids
            or tuple(f["hidden_states"].shape) != tuple(ref[i].shape)
        ):
            return float("inf")
        for slot in range(ref[i].shape[1]):
            worst = max(worst, rel_err(f["hidden_states"][:, slot], ref[i][:, slot]))
    return worst


def tp_diff(a: dict[int, Any], b: dict[int, Any]) -> float:
    """max |a - b| over all files of two runs (same samples)."""
    if sorted(a) != sorted(b) or not a:
        return float("inf")
    return max(float((a[i]["hidden_states"].float() - b[i]["hidden_states"].float()).abs().max()) for i in a)


def case(model: str, backend: str, tp: int, graphs: bool, runner_env: str | None = None) -> dict[str, Any]:
    """One correctness run's settings."""
    tag = f"{model}-{backend}-tp{tp}-{'graphs' if graphs else 'eager'}" + (
        f"-v{runner_env}" if runner_env else ""
    )
    return {
        "tag": tag,
        "model": model,
        "backend": backend,
        "tp": tp,
        "graphs": graphs,
        "runner_env": runner_env,
    }


CASES_TP1 = [
    case("llama-tiny", "worker-extension", 1, False),
    case("llama-tiny", "worker-extension", 1, False, runner_env="1"),  # V1 forced: both runners checked
    case("llama-tiny", "vllm-native", 1, True),
    case("llama-tiny", "vllm-native", 1, False),
    case("deepseek-v3-tiny", "worker-extension", 1, False),
    case("deepseek-v3-tiny", "worker-extension", 1, False, runner_env="2"),  # V2 forced for MLA + MoE
    case("deepseek-v3-tiny", "vllm-native", 1, True),
    case("deepseek-v3-tiny", "vllm-native", 1, False),
]
CASES_TP2 = [
    case("llama-tiny", "worker-extension", 2, False),
    case("llama-tiny", "vllm-native", 2, True),
    case("deepseek-v3-tiny", "worker-extension", 2, False),
    case("deepseek-v3-tiny", "vllm-native", 2, True),
]
#: phase `writer`: the worker extension again after a change to its write path, plus DeepSeek-V3 with every
#: routed expert active (top-8 of 8), where no near-tied router score can flip an expert choice
WRITER_TP1 = [
    *[c for c in CASES_TP1 if c["backend"] == "worker-extension"],
    case("deepseek-v3-tiny-dense", "worker-extension", 1, False),
    case("deepseek-v3-tiny-dense", "vllm-native", 1, True),
]
WRITER_TP2 = [c for c in CASES_TP2 if c["backend"] == "worker-extension"]
#: phase `graphs`: the worker extension with CUDA graphs on (the aux capture path, V1 selected), beside
#: the eager hooks path on the same prompts
GRAPHS_TP1 = [
    case("llama-tiny", "worker-extension", 1, True),
    case("deepseek-v3-tiny", "worker-extension", 1, True),
    case("deepseek-v3-tiny-dense", "worker-extension", 1, True),
    case("llama-tiny", "worker-extension", 1, False),
    case("deepseek-v3-tiny-dense", "worker-extension", 1, False),
]
GRAPHS_TP2 = [
    case("llama-tiny", "worker-extension", 2, True),
    case("deepseek-v3-tiny", "worker-extension", 2, True),
]
#: phase `current`: the correctness matrix plus the worker extension's shipped default (CUDA graphs on, the
#: aux capture path), so one call checks the code as it ships against HF
CURRENT_TP1 = CASES_TP1 + [c for c in GRAPHS_TP1 if c["graphs"]]
#: …and at TP=2 (two GPUs) the dense-routing DeepSeek-V3 too: the top-2 model's TP=2 vs TP=1 difference is
#: dominated by expert-routing flips, so only the dense one shows whether TP=2 equals TP=1 for MLA + MoE
CURRENT_TP2 = [*CASES_TP2, case("deepseek-v3-tiny-dense", "worker-extension", 2, True)]
#: phase `versions`: another vLLM release (its own wheelhouse, GPUWH_SITE): both backends on the tiny Llama,
#: eager and with graphs, and the aux path on a dense-routing DeepSeek-V3
VERSIONS_TP1 = [
    case("llama-tiny", "worker-extension", 1, False),
    case("llama-tiny", "worker-extension", 1, True),
    case("llama-tiny", "vllm-native", 1, True),
    case("deepseek-v3-tiny-dense", "worker-extension", 1, True),
]
RUNNER_ENV = {"1": "0", "2": "1"}  # case runner_env (V1/V2 forced) -> VLLM_USE_V2_MODEL_RUNNER


def run_case(
    c: dict[str, Any], models: dict[str, Path], data: Path, logs: Path, gpus: str, retry: bool = False
) -> dict[str, Any]:
    """One correctness run (fresh output dir)."""
    # a fixed KV size skips vLLM's memory profiling, which asserts when a neighbour frees memory meanwhile
    args = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.12", "--kv-cache-memory-bytes", "2G"]
    args += ["--max-num-batched-tokens", "256"]
    if not c["graphs"]:
        args.append("--enforce-eager")
    spec = {
        "name": c["tag"],
        "backend": c["backend"],
        "model": str(models[c["model"]]),
        "dataset": str(data),
        "output_dir": str(WORK / "out" / c["tag"]),
        "layers": TINY_LAYERS,
        "batch_size": 4,
        "tensor_parallel_size": c["tp"],
        "vllm_args": args,
    }
    extra = {"CUDA_VISIBLE_DEVICES": gpus}
    if c["runner_env"]:
        extra["VLLM_USE_V2_MODEL_RUNNER"] = RUNNER_ENV[c["runner_env"]]
    shutil.rmtree(spec["output_dir"], ignore_errors=True)  # no resume from an earlier call's files
    res = run_job(c["tag"] + ("-retry" if retry else ""), spec, extra, logs)
    res["out"] = Path(spec["output_dir"])
    return res


def correctness(
    logs: Path, version: str, tp1: list[dict[str, Any]], tp2: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The tiny-model matrix; records with HF and TP=1 comparisons."""
    from agent.extract.tinymodel import build
    from tests.extract.reference import hf_states

    models = {
        "llama-tiny": build(WORK / "llama", "llama", seed=3),
        # DeepSeek's own MLA head dims: vLLM's GPU MLA prefill backends take no others
        "deepseek-v3-tiny": build(WORK / "dsv3", "deepseek_v3", seed=3, overrides=GPU_MLA_DIMS),
        "deepseek-v3-tiny-dense": build(
            WORK / "dsv3-dense", "deepseek_v3", seed=3, overrides={**GPU_MLA_DIMS, "num_experts_per_tok": 8}
        ),
    }
    data = WORK / "tiny.jsonl"
    samples = make_data(data, [5, 37, 12, 64, 1, 50, 23, 200], 500, 7)
    refs = {m: hf_states(p, samples, TINY_LAYERS) for m, p in models.items()}
    ngpu = gpu_count()
    if ngpu < 2 and tp2:  # a one-GPU kind: TP=2 cannot run here, and says so rather than failing
        print(f"[run_gpu] {ngpu} GPU(s): the {len(tp2)} TP=2 cases are not run", flush=True)
        tp2 = []
    results: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=4 * ngpu) as pool:  # TP=1 runs share the GPUs, four at a time each
        futs = {
            c["tag"]: pool.submit(run_case, c, models, data, logs, str(i % ngpu)) for i, c in enumerate(tp1)
        }
        results.update({t: f.result() for t, f in futs.items()})
    with ThreadPoolExecutor(max_workers=4) as pool:
        futs = {c["tag"]: pool.submit(run_case, c, models, data, logs, "0,1") for c in tp2}
        results.update({t: f.result() for t, f in futs.items()})
    for c in tp1 + tp2:  # a run that failed beside others gets one more try, alone
        if results[c["tag"]]["rc"] != 0:
            results[c["tag"]] = run_case(c, models, data, logs, "0" if c["tp"] == 1 else "0,1", retry=True)
    records = []
    for c in tp1 + tp2:
        res = results[c["tag"]]
        files = load_files(res["out"])
        err = compare(files, refs[c["model"]], samples) if res["rc"] == 0 else None
        diff = None
        if c["tp"] == 2 and res["rc"] == 0:
            same = [x for x in tp1 if x["model"] == c["model"] and x["backend"] == c["backend"]]
            base = next(
                (x for x in same if x["graphs"] == c["graphs"] and not x["runner_env"]),
                next(x for x in same if not x["runner_env"]),
            )
            diff = tp_diff(files, load_files(results[base["tag"]]["out"]))
        ms = milestones(res["log"], c["tp"])
        conf = next((e for e in res["events"] if e["kind"] == "engine_config"), {})
        cap = next((e for e in res["events"] if e["kind"] == "capture_configured"), {})
        ok = res["rc"] == 0 and err is not None and err <= BF16_TOL and diff != float("inf")
        want_kinds = {"weights_loaded", "kv_cache_ready", "engine_ready"}
        if c["graphs"] and conf.get("cuda_graphs"):  # the job may run eager instead
            want_kinds.add("cuda_graphs_captured")
        if c["backend"] == "worker-extension":
            want_kinds.add("extension_injected")
            # one milestone; at TP=1 the worker lives in EngineCore, whose prefix names no rank
            ok = (
                ok
                and len(ms["injected"]) == 1
                and (c["tp"] == 1 or ms["injected"][0] == list(range(c["tp"])))
            )
        ok = ok and want_kinds <= set(ms["kinds"])
        records.append(
            {
                "gpu": "H200",
                "gpus": c["tp"],
                "tp": c["tp"],
                "model": c["model"],
                "backend": c["backend"],
                "vllm": version,
                "cuda_graphs": bool(cap and conf.get("cuda_graphs")),
                "files": len(files),
                "max_rel_err": err,
                "tp1_max_abs_diff": diff,
                "overhead_ratio": None,
                "ok": ok,
                "note": describe(c, res, conf, cap, ms),
            }
        )
        print(json.dumps(records[-1]), flush=True)
    return records


def describe(
    c: dict[str, Any], res: dict[str, Any], conf: dict[str, Any], cap: dict[str, Any], ms: dict[str, Any]
) -> str:
    """The record's note: runner, milestones, ranks, failure reason, time."""
    runner = cap.get("model_runner") or conf.get("model_runner")
    failed = next((e.get("reason") for e in res["events"] if e["kind"] == "failed"), None)
    gathers = next((e.get("sp_gathers") for e in res["events"] if e["kind"] == "completed"), None)
    parts = [
        f"runner {runner} ({conf.get('runner_reason')})",
        f"capture {cap.get('capture') or conf.get('capture')} ({conf.get('capture_reason')})",
        f"asked graphs={'on' if c['graphs'] else 'off'}",
        f"milestones {ms['kinds']}",
        f"injected ranks {ms['injected']}" if ms["injected"] else "",
        f"error classes {ms['errors']}" if ms["errors"] else "",
        f"sp gathers {gathers}" if gathers is not None else "",
        f"FAILED: {str(failed)[:600]}" if failed else "",
        f"{res['seconds']} s",
    ]
    return "; ".join(x for x in parts if x)


def main() -> int:
    """Run a phase; write DIR/validation.json and DIR/logs.tar.gz."""
    p = argparse.ArgumentParser()
    p.add_argument(
        "phase",
        choices=[
            "smoke",
            "correctness",
            "current",
            "versions",
            "versions-mla",
            "writer",
            "graphs",
            "overhead",
            "overhead-quick",
            "overhead-writer",
            "overhead-graphs",
            "overhead-runners",
            "overhead-long",
            "overhead-tune",
            "overhead-warm",
            "overhead-confirm",
            "overhead-e2e",
            "overhead-e2ekernel",
        ],
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    args = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    logs = WORK / f"logs-{args.phase}"
    logs.mkdir(exist_ok=True)
    version = vllm_version()
    print(f"vLLM {version}", flush=True)
    if args.phase == "smoke":
        records = correctness(logs, version, CASES_TP1[:1], [])
    elif args.phase == "correctness":
        records = correctness(logs, version, CASES_TP1, CASES_TP2)
    elif args.phase == "current":
        records = correctness(logs, version, CURRENT_TP1, CURRENT_TP2)
    elif args.phase == "versions":
        records = correctness(logs, version, VERSIONS_TP1, [])
    elif args.phase == "versions-mla":
        records = correctness(logs, version, VERSIONS_TP1[3:], [])
    elif args.phase == "writer":
        records = correctness(logs, version, WRITER_TP1, WRITER_TP2)
    elif args.phase == "graphs":
        records = correctness(logs, version, GRAPHS_TP1, GRAPHS_TP2)
    else:
        from tests.gpu.overhead import overhead

        records = overhead(WORK, logs, version, env_for, mode=args.phase.partition("-")[2] or "full")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"validation-{args.phase}.json").write_text(json.dumps(records, indent=1) + "\n")
    with tarfile.open(args.out / f"logs-{args.phase}.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname=logs.name)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
