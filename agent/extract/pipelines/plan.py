"""The argv of the users' own pipelines (backends ``speculators`` and ``specforge``): pure, from a RunSpec.

speculators is two processes: a vLLM server started for ``extract_hidden_states`` (its ``launch_vllm.py``
from a checkout, or the same ``vllm serve`` line built here for the installed package, which ships no
launcher) and, once the server answers, its offline client (``data_generation_offline.py`` or
``python -m speculators generate-offline-data``). SpecForge is one ``torchrun`` of its
``prepare_hidden_states.py``. The spec's common fields map onto their flags; their own extra flags come
last, as argv items, so a flag given there wins (argparse keeps the last value).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from agent.spec import RunSpec, SpecForgeOptions, SpeculatorsOptions, eagle3_default_layers

#: Tags of the processes of a speculators job, printed before each of their log lines ("[server] …").
SERVER, CLIENT = "server", "client"
HOST = "127.0.0.1"


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
    shift = 1 if spec.layer_convention == "output" else 0
    return [i + shift for i in spec.layers]


def speculators_plan(spec: RunSpec, python: str, num_hidden_layers: int, staging: str) -> PairPlan:
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
    ]
    if opts.scripts_dir:
        server_argv = [
            python, os.path.join(opts.scripts_dir, "launch_vllm.py"), model,
            "--hidden-states-path", staging,
            "--target-layer-ids", *map(str, layers),
            "--", *serve, *spec.vllm_args,
        ]  # fmt: skip
    else:
        speculative = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        }
        transfer = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": staging},
        }
        server_argv = [
            *(opts.server_command or [python, "-m", "vllm.entrypoints.cli.main", "serve", model]),
            "--speculative_config", json.dumps(speculative),
            "--kv_transfer_config", json.dumps(transfer),
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
        server=Process(SERVER, server_argv),
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
