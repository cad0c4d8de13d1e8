"""Backend names: one definition, read strictly from data files and specs."""

from __future__ import annotations

import pytest

from agent import backends
from agent.backends import OWN, PIPELINES, SUMMARY, Backend
from agent.milestones.rulefile import BUILTIN_DIR, PIPELINE_FILES


def test_every_backend_is_own_a_pipeline_or_command_and_has_a_summary() -> None:
    assert sorted([*OWN, *PIPELINES, Backend.COMMAND]) == sorted(Backend)
    assert set(SUMMARY) == set(Backend)
    assert all((BUILTIN_DIR / name).is_file() for name in PIPELINE_FILES)  # one rule file per pipeline


def test_parse_takes_names_and_refuses_others_naming_where() -> None:
    assert backends.parse("vllm-native", "x") is Backend.VLLM_NATIVE
    with pytest.raises(
        backends.UnknownBackend, match=r"^t\.toml: unknown backend 'vllm_native'; expected one of "
    ):
        backends.parse("vllm_native", "t.toml")
    with pytest.raises(backends.UnknownBackend, match=r"expected one of worker-extension, vllm-native$"):
        backends.parse("command", "bug", OWN)
    with pytest.raises(backends.UnknownBackend, match="unknown backend '3'"):
        backends.parse(3, "spec")
