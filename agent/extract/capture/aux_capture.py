"""Capture through vLLM's own EAGLE-3 aux hidden-state outputs, so torch.compile and CUDA graphs stay on.

Aux index k is the residual stream entering layer k (k = N: leaving the last layer), the "input" convention.
Dynamo reads the aux setting while it traces, so it must be set after the weights load and before the first
forward. A worker extension cannot override `Worker.load_model` (vLLM refuses a mixin that shadows a worker
attribute), so importing this module in a worker wraps it instead, acting only where the job put the aux
indices in `settings.AUX_LAYERS` (an environment variable spawned workers inherit).
"""

from __future__ import annotations

import functools
from typing import Any

from agent import settings


def aux_index(layer_id: int, convention: str, n: int) -> int:
    """The aux index of a requested layer id: input k → k (0..N); output k → k + 1 (0..N-1)."""
    if convention == "input":
        if not 0 <= layer_id <= n:
            raise ValueError(f"layer id {layer_id} out of range 0..{n} (convention input)")
        return layer_id
    if not 0 <= layer_id < n:
        raise ValueError(f"layer id {layer_id} out of range 0..{n - 1} (convention output)")
    return layer_id + 1


def aux_plan(layer_ids: list[int], convention: str, n: int) -> tuple[tuple[int, ...], list[int]]:
    """(aux indices to turn on, ascending and unique; per slot, its position in the model's aux list)."""
    wanted = [aux_index(k, convention, n) for k in layer_ids]
    order = tuple(sorted(set(wanted)))
    return order, [order.index(w) for w in wanted]


def env_value(layer_ids: list[int], convention: str, n: int) -> str:
    """What the job puts in settings.AUX_LAYERS for these layers."""
    return ",".join(str(i) for i in aux_plan(layer_ids, convention, n)[0])


def enable(runner: Any, layers: tuple[int, ...]) -> None:
    """Turn on the model's aux outputs and tell the runner to unpack them; RuntimeError if unsupported."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    model: Any = runner.get_model()
    supported: bool = supports_eagle3(model)
    if not supported:
        raise RuntimeError(
            f"{type(model).__name__} has no EAGLE-3 aux hidden-state outputs in this vLLM, so the capture "
            "cannot run inside the compiled model: add --enforce-eager to vllm_args, or set "
            f"{settings.CAPTURE.name}=hooks"
        )
    model.set_aux_hidden_state_layers(layers)
    # the runner (and its dummy runs) then unpack (hidden, aux); without a drafter aux is otherwise unused
    runner.use_aux_hidden_state_outputs = True


def install() -> None:
    """Wrap vLLM's Worker.load_model (once per process) to turn aux outputs on where the job asked."""
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.load_model, "_eaglewatch", False):
        return
    orig = Worker.load_model

    @functools.wraps(orig)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        layers = settings.AUX_LAYERS.get()
        if layers is not None:
            enable(self.model_runner, layers)
        return out

    load_model._eaglewatch = True  # type: ignore[attr-defined]
    Worker.load_model = load_model  # type: ignore[method-assign]


def split_output(out: Any, count: int) -> list[Any]:
    """The aux states of one forward's output; RuntimeError when the model did not return `count` of them."""
    if not isinstance(out, tuple) or len(out) != 2 or len(out[1]) != count:
        got = len(out[1]) if isinstance(out, tuple) and len(out) == 2 else 0
        raise RuntimeError(f"the model returned {got} aux hidden states, the capture asked for {count}")
    return list(out[1])
