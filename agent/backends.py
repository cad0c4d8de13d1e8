"""The backends a run spec names: each spelled once, here (stdlib only: the daemon imports it too)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class Backend(StrEnum):
    """What a run's job is; the value is the name in specs, data files and the web form."""

    WORKER_EXTENSION = "worker-extension"
    VLLM_NATIVE = "vllm-native"
    COMMAND = "command"
    SPECULATORS = "speculators"
    SPECFORGE = "specforge"


#: What a spec that names no backend runs.
DEFAULT = Backend.WORKER_EXTENSION
#: One line on each backend (the web form's labels).
SUMMARY: dict[Backend, str] = {
    Backend.WORKER_EXTENSION: "vLLM with eaglewatch's worker extension",
    Backend.VLLM_NATIVE: "vLLM's own extract_hidden_states",
    Backend.COMMAND: "watch any job",
    Backend.SPECULATORS: "speculators' vLLM server + offline client",
    Backend.SPECFORGE: "SpecForge's torchrun prepare_hidden_states.py",
}
#: eaglewatch's own capture through vLLM (agent/extract/engine/driver.py, native.py).
OWN = (Backend.WORKER_EXTENSION, Backend.VLLM_NATIVE)
#: A user's own pipeline, run as the job (agent/extract/pipelines/run.py): no eaglewatch manifest.
PIPELINES = (Backend.SPECULATORS, Backend.SPECFORGE)


class UnknownBackend(ValueError):
    """A name that is not one of the allowed backends; the message names where it was read."""


def parse(name: object, where: str, allowed: Iterable[Backend] = Backend) -> Backend:
    """``name`` as a Backend among ``allowed``; UnknownBackend naming ``where`` and the choices otherwise."""
    choices = tuple(allowed)
    if isinstance(name, str) and name in choices:
        return Backend(name)
    expected = ", ".join(choices)
    raise UnknownBackend(f"{where}: unknown backend {str(name)[:40]!r}; expected one of {expected}")
