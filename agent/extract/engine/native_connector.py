"""Our hidden-states connector for vLLM's `extract_hidden_states` method: the stock one, plus a CPU path.

vLLM's ExampleHiddenStatesConnector pins memory and uses a CUDA copy stream, so its first write fails off
the GPU; there this class writes the request's rows synchronously (still under the `.lock` protocol).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from agent.extract.writing.writer import write_safetensors


class _Done:
    """Stands in for a CUDA event of a copy that already happened (the CPU path copies synchronously)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class EagleWatchHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a synchronous write when the cache is not on a CUDA device."""

    def _submit_async_write(self, pending: Any) -> None:
        if self._kv_cache is not None and self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_size = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(block_size).reshape(1, -1) + blocks.reshape(-1, 1) * block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        tmp = f"{pending.filename}.{os.getpid()}.tmp"
        try:
            write_safetensors(tmp, {"hidden_states": hidden, "token_ids": pending.token_ids.clone()})  # type: ignore[arg-type]
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH proceed
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]
