"""Starting vLLM for a capture: engine arguments, platform and capture defaults, engine_config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent import settings
from agent.extract import signals
from agent.extract.engine import runtime
from agent.extract.planning.forecast import cpu_flags
from agent.extract.planning.preflight import Plan


class CaptureFailed(RuntimeError):
    """The run must stop (policy stop on a bad sample, or a worker error); the message is the reason."""


@dataclass(frozen=True)
class Tuning:
    """The capture's tuning knobs (agent/settings.py) one worker runs with, for capture_configured."""

    pinned_buffers: int
    writers: int
    writeback_mb: int
    trace: str | None

    def fields(self) -> dict[str, object]:
        """The capture_configured fields (the trace path only when set)."""
        out = {k: v for k, v in asdict(self).items() if k != "trace"}
        return {**out, **({"trace": self.trace} if self.trace else {})}


def tuning_from_env(env: Mapping[str, str] | None = None) -> Tuning:
    """The tuning in env (default os.environ; the job's env reaches every worker); SettingError naming the
    variable when one is malformed."""
    return Tuning(
        pinned_buffers=settings.PINNED_BUFFERS.get(env),
        writers=settings.WRITERS.get(env),
        writeback_mb=settings.WRITEBACK_MB.get(env),
        trace=settings.COSTS_TRACE.get(env),
    )


def engine_kwargs(model: str, vllm_args: list[str]) -> dict[str, Any]:
    """Turn the spec's vllm_args (CLI-style argv) into LLM(...) keyword arguments (non-defaults only)."""
    if not vllm_args:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    base = vars(parser.parse_args(["--model", model]))
    got = vars(parser.parse_args(["--model", model, *vllm_args]))
    return {k: v for k, v in got.items() if v != base.get(k) and k != "model"}


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4 << 30


def platform_defaults(
    platform: str, env: Mapping[str, str], vllm_args: list[str], tp: int, model_dtype: str
) -> runtime.EngineDefaults:
    """This host's engine defaults for a platform (vLLM's device type) where the user's env and args set
    none."""
    if platform == "cpu":
        return runtime.cpu_defaults(
            env, vllm_args, tp, sorted(os.sched_getaffinity(0)), cpu_flags(), _mem_available(), model_dtype
        )
    if platform == "cuda" and "VLLM_WORKER_MULTIPROC_METHOD" not in env:
        return runtime.EngineDefaults(
            {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
            [],
            {"VLLM_WORKER_MULTIPROC_METHOD": "spawn: forked workers can hang on CUDA"},
        )
    return runtime.EngineDefaults({}, [], {})


def prepare_engine(plan: Plan) -> tuple[list[str], runtime.CaptureChoice]:
    """Apply the capture, runner and platform defaults to os.environ; emit engine_config. Returns the extra
    engine arguments and the capture choice."""
    from vllm.platforms import current_platform

    spec = plan.spec
    platform = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
    user_env = {**os.environ, **spec.env}  # the spec's env was applied already; either way it is the user's
    base = platform_defaults(platform, user_env, spec.vllm_args, spec.tensor_parallel_size, plan.dtype)
    defaults, reasons = dict(base.env), dict(base.reasons)
    args, warnings = base.args, base.warnings
    version = runtime.parse_version(plan.vllm_version) or (0, 0, 0)
    try:
        capture = runtime.choose_capture(spec.backend, platform, spec.vllm_args, user_env, plan.aux_refused)
    except runtime.CaptureConflict as e:
        raise CaptureFailed(str(e)) from None
    choice = runtime.choose_runner(
        spec.backend,
        version,
        platform,
        plan.architectures,
        plan.moe,
        runtime.flag(user_env.get(runtime.RUNNER_ENV)),
        capture,
    )
    defaults.update(choice.set_env)
    if choice.set_env:
        reasons[runtime.RUNNER_ENV] = choice.reason
    if capture.set_env:
        defaults.update(capture.set_env)
        reasons.update(
            {
                k: "compile cache off: it would load a model compiled without aux outputs"
                for k in capture.set_env
            }
        )
    if capture.path == "aux":
        from agent.extract.capture import aux_capture

        # read by the wrapped Worker.load_model in each worker, which inherits this environment
        defaults[settings.AUX_LAYERS.name] = aux_capture.env_value(
            plan.layer_ids, spec.layer_convention, plan.num_hidden_layers
        )
    os.environ.update(defaults)
    signals.emit(
        "engine_config",
        source="eaglewatch",
        platform=platform,
        vllm=plan.vllm_version,
        model_runner=choice.runner,
        runner_reason=choice.reason,
        cuda_graphs=capture.compiled and platform == "cuda",
        compiled=capture.compiled,
        capture=capture.path,
        capture_reason=capture.reason,
        defaults={**defaults, **({"vllm_args": args} if args else {})},
        reasons=reasons,
    )
    for key, why in reasons.items():
        signals.say(f"default {key}: {why}")
    signals.say(f"model runner {choice.runner}: {choice.reason}")
    signals.say(f"capture {capture.path}, {'compiled' if capture.compiled else 'eager'}: {capture.reason}")
    if plan.version_note:
        signals.emit("warning", source="eaglewatch", message=plan.version_note)
    aux_warnings = plan.aux_warnings if capture.path == "aux" else ()
    for message in (*warnings, *plan.bug_warnings, *aux_warnings):
        signals.emit("warning", source="eaglewatch", message=message)
    return args, capture


def one_result(results: Any) -> Any:
    """collective_rpc gives a list (one entry per worker) or one value (unique reply rank): rank 0's."""
    if isinstance(results, list):
        found = [r for r in results if r is not None]
        if len(found) != 1:
            raise CaptureFailed(f"expected one reply from TP rank 0, got {len(found)} of {len(results)}")
        return found[0]
    return results
