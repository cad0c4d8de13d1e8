"""Test-only worker extension: also records vLLM's own EAGLE-3 aux hidden states on the same engine steps.

It turns on the model's `set_aux_hidden_state_layers` (the mechanism that defines the "input" convention),
strips the aux list from the backbone's return value so the runner sees a plain tensor, and assembles the
aux tensors per request with the same spans into a second directory (env EAGLEWATCH_AUX_DIR).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from agent.extract.capture.assembly import CaptureSink, SinkConfig, spans_for_step
from agent.extract.capture.worker_ext import IDX_KEY, EagleWatchCapture
from agent.extract.engine.canary import CANARY_KEY


class AuxCompareCapture(EagleWatchCapture):
    """EagleWatchCapture plus a second sink fed from vLLM's aux hidden states."""

    def eaglewatch_setup(self, cfg: dict[str, Any]) -> dict[str, Any] | None:
        info = super().eaglewatch_setup(cfg)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        model.set_aux_hidden_state_layers(tuple(cfg["layer_ids"]))
        hidden = int(self.vllm_config.model_config.hf_text_config.hidden_size)  # type: ignore[attr-defined]
        aux_dir = os.environ["EAGLEWATCH_AUX_DIR"]
        # like the capture itself, only TP rank 0 writes (aux states are replicated across ranks)
        self._aux_sink = (
            CaptureSink(SinkConfig(aux_dir, len(cfg["layer_ids"]), hidden)) if self._ew_rank0 else None
        )
        self._aux_step: torch.Tensor | None = None
        inner = model.model
        orig = inner.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            if isinstance(out, tuple):
                self._aux_step = torch.stack(list(out[1]), dim=1)
                return out[0]
            return out

        inner.forward = forward
        return info

    def eaglewatch_drain(self, wait: bool = True) -> dict[str, Any] | None:
        """Drain both sinks, so the aux files are complete whenever the driver's batch is."""
        out = super().eaglewatch_drain(wait)
        if self._aux_sink is None:
            return out
        aux = self._aux_sink.drain()
        errors = [r["error"] for r in aux if "error" in r]
        if errors:
            raise RuntimeError(f"aux sink failed: {errors[0]}")
        return out

    def _ew_begin(self, so: Any) -> None:
        super()._ew_begin(so)
        if self._aux_sink is None:
            return
        for new in so.scheduled_new_reqs:
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            # a canary re-capture is compared, never written: its aux states would overwrite the batched ones
            if IDX_KEY in extra and not extra.get(CANARY_KEY) and new.prompt_token_ids is not None:
                self._aux_sink.register(new.req_id, int(extra[IDX_KEY]), list(new.prompt_token_ids))

    def _ew_end(self) -> None:
        step = self._ew_active
        super()._ew_end()
        aux, self._aux_step = self._aux_step, None
        if step is None or aux is None or step.order is None or self._aux_sink is None:
            return
        spans = spans_for_step(step.order, dict(step.so.num_scheduled_tokens), step.starts)
        self._aux_sink.submit(aux[: step.so.total_num_scheduled_tokens].clone(), spans)
