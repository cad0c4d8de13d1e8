"""The known-bug gate: the shipped table as case tables; the preflight refuses or warns before any engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.extract.engine import known_bugs
from agent.extract.engine.known_bugs import (
    BugTableError,
    KnownBug,
    Target,
    aux_path_bugs,
    aux_refusal,
    gate,
    load_bugs,
    match,
    parse_bugs,
    target_for,
)
from agent.extract.planning.preflight import SpecError, preflight, vllm_version
from agent.spec import RunSpec, parse_spec

BUGS = load_bugs()
FINAL = frozenset({"captures_final_layer"})
AUX = frozenset({"aux_outputs"})
FINAL_AUX = FINAL | AUX
VLM = frozenset({"vlm_wrapper"})
DSV3, KIMI25, LLAMA = ("DeepseekV3ForCausalLM",), ("KimiK25ForConditionalGeneration",), ("LlamaForCausalLM",)

ALLOW_ENV = "EAGLEWATCH_ALLOW_KNOWN_BUGS"


@pytest.mark.parametrize(
    ("version", "archs", "backend", "conditions", "want"),
    [
        # DeepSeek-V2 family, final layer read from vLLM's aux outputs: dropped before 0.25.0
        ("0.24.0", DSV3, "vllm-native", FINAL_AUX, ["deepseek-v2-final-layer-drop"]),
        ("0.19.1", KIMI25, "vllm-native", FINAL_AUX, ["deepseek-v2-final-layer-drop"]),
        ("0.24.9rc1", DSV3, "vllm-native", FINAL_AUX, ["deepseek-v2-final-layer-drop"]),
        ("0.20.0", DSV3, "worker-extension", FINAL_AUX, ["deepseek-v2-final-layer-drop"]),  # its aux path
        ("0.25.0", DSV3, "vllm-native", FINAL_AUX, []),  # the fix (PR #46973)
        ("0.26.0", DSV3, "vllm-native", FINAL_AUX, []),
        ("0.24.0", DSV3, "worker-extension", FINAL, []),  # its layer hooks capture the final layer themselves
        ("0.24.0", DSV3, "vllm-native", AUX, []),  # final layer not requested
        ("0.24.0", LLAMA, "vllm-native", FINAL_AUX, []),
        # VLM wrapper under extract_hidden_states on 0.18
        ("0.18.0", LLAMA, "vllm-native", VLM, ["vlm-text-config-attention-heads"]),
        ("0.18.1", LLAMA, "vllm-native", VLM | FINAL_AUX, ["vlm-text-config-attention-heads"]),
        (
            "0.18.0",
            KIMI25,
            "vllm-native",
            VLM | FINAL_AUX,
            ["deepseek-v2-final-layer-drop", "vlm-text-config-attention-heads"],
        ),
        ("0.19.0", LLAMA, "vllm-native", VLM, []),
        ("0.17.1", LLAMA, "vllm-native", VLM, []),
        ("0.18.0", LLAMA, "vllm-native", frozenset(), []),
        ("0.18.0", LLAMA, "worker-extension", VLM, []),
        # a version that cannot be read matches no range (the version gate deals with it)
        ("unknown", DSV3, "vllm-native", FINAL_AUX, []),
    ],
)
def test_shipped_table_matches(
    version: str, archs: tuple[str, ...], backend: str, conditions: frozenset[str], want: list[str]
) -> None:
    assert [b.id for b in match(BUGS, Target(version, archs, backend, conditions))] == want


@pytest.mark.parametrize(
    ("config", "layers", "convention", "want"),
    [
        ({}, [2, 4, 5, 8], "input", FINAL),
        ({}, [2, 4, 5, 7], "output", FINAL),
        ({}, [2, 4, 5, 7], "input", frozenset()),
        ({"text_config": {"num_hidden_layers": 8}}, [2], "input", VLM),
        ({"text_config": None}, [8], "input", FINAL),
    ],
)
def test_run_conditions(
    config: dict[str, object], layers: list[int], convention: str, want: frozenset[str]
) -> None:
    config = {**config, "num_hidden_layers": 8}
    assert target_for("0.26.0", config, "worker-extension", layers, convention).conditions == want


def test_target_for_a_vlm_wrapper_names_both_architectures() -> None:
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "num_hidden_layers": 61,
           "text_config": {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61}}  # fmt: skip
    target = target_for("0.24.0", cfg, "vllm-native", [2, 30, 58, 61], "input")
    assert target == Target("0.24.0", (*KIMI25, *DSV3), "vllm-native", FINAL | VLM | AUX)
    # the worker extension reads aux outputs only on its compiled path, chosen after the preflight
    hooks = target_for("0.24.0", cfg, "worker-extension", [2, 30, 58, 61], "input")
    assert hooks.conditions == FINAL | VLM
    assert [b.id for b in aux_path_bugs(BUGS, hooks)] == ["deepseek-v2-final-layer-drop"]
    assert aux_path_bugs(BUGS, target) == []  # vllm-native: gated by the preflight itself


def test_gate_refuses_warns_and_allows() -> None:
    target = Target("0.24.0", DSV3, "vllm-native", FINAL_AUX)
    refusals, warnings = gate(BUGS, target, frozenset())
    assert warnings == [] and len(refusals) == 1
    assert "drops the final layer" in refusals[0] and "vllm/issues/48124" in refusals[0]
    assert f"{ALLOW_ENV}=deepseek-v2-final-layer-drop" in refusals[0]
    refusals, warnings = gate(BUGS, target, frozenset({"deepseek-v2-final-layer-drop"}))
    assert refusals == [] and len(warnings) == 1 and "capturing anyway" in warnings[0]
    soft = parse_bugs({"bug": [{"id": "w", "severity": "warning", "message": "m", "link": "l"}]})
    assert gate(soft, target, frozenset()) == ([], ["known vLLM bug w: m (l)"])


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ({"id": "x", "severity": "fatal", "message": "m", "link": "l"}, "severity must be"),
        ({"id": "x", "severity": "refuse", "message": "", "link": "l"}, "message must be"),
        (
            {"id": "x", "severity": "refuse", "message": "m", "link": "l", "vllm_below": "soon"},
            "not a version",
        ),
        (
            {"id": "x", "severity": "refuse", "message": "m", "link": "l", "backends": ["sglang"]},
            "backends: unknown backend 'sglang'; expected one of worker-extension, vllm-native",
        ),
        ({"id": "x", "severity": "refuse", "message": "m", "link": "l", "when": ["tuesday"]}, "unknown when"),
        ({"id": "x", "severity": "refuse", "message": "m", "link": "l", "arch": ["A"]}, "unknown field"),
    ],
)
def test_bad_table_entries_are_named(entry: dict[str, object], error: str) -> None:
    with pytest.raises(BugTableError, match=error):
        parse_bugs({"bug": [entry]})


def _spec(tmp_path: Path, config: dict[str, object], **over: object) -> RunSpec:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(config))
    data = tmp_path / "data.jsonl"
    data.write_text('{"token_ids": [1, 2, 3]}\n')
    base: dict[str, object] = {
        "host": "local",
        "backend": "vllm-native",
        "model": str(model),
        "dataset": str(data),
        "output_dir": str(tmp_path / "out"),
    }
    return parse_spec({**base, **over})


def _here(severity: str, when: tuple[str, ...] = ("captures_final_layer",)) -> list[KnownBug]:
    """A bug entry that applies to the vLLM installed here (its real version), for DeepSeek-V3 models."""
    return parse_bugs(
        {
            "bug": [
                {
                    "id": "here",
                    "severity": severity,
                    "message": "drops the final layer",
                    "link": "https://example.invalid/1",
                    "vllm_min": "0.0.0",
                    "archs": ["DeepseekV3ForCausalLM"],
                    "when": list(when),
                }
            ]
        }
    )


DS_CONFIG = {"num_hidden_layers": 8, "hidden_size": 64, "architectures": ["DeepseekV3ForCausalLM"]}


def _table(monkeypatch: pytest.MonkeyPatch, bugs: list[KnownBug]) -> None:
    """The preflight reads this known-bug table in place of the shipped one."""
    monkeypatch.setattr(known_bugs, "load_bugs", lambda: bugs)


@pytest.mark.skipif(vllm_version() is None, reason="the preflight needs an installed vLLM")
def test_preflight_refuses_a_known_bug_before_any_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path, DS_CONFIG)
    _table(monkeypatch, _here("refuse"))
    with pytest.raises(
        SpecError, match=r"known vLLM bug here: drops the final layer \(https://example.invalid/1\)"
    ):
        preflight(spec)
    assert not (tmp_path / "out").exists()  # refused before anything was made


@pytest.mark.skipif(vllm_version() is None, reason="the preflight needs an installed vLLM")
def test_preflight_passes_warnings_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _table(monkeypatch, _here("warning"))
    plan = preflight(_spec(tmp_path, DS_CONFIG))
    assert plan.bug_warnings == ("known vLLM bug here: drops the final layer (https://example.invalid/1)",)
    _table(monkeypatch, _here("refuse"))
    allowed = _spec(tmp_path / "b", DS_CONFIG, env={ALLOW_ENV: "other, here"})
    assert "capturing anyway" in preflight(allowed).bug_warnings[0]
    not_final = _spec(tmp_path / "c", DS_CONFIG, layers=[2, 4])
    assert preflight(not_final).bug_warnings == ()


@pytest.mark.skipif(vllm_version() is None, reason="the preflight needs an installed vLLM")
def test_preflight_hands_an_aux_output_bug_to_the_worker_extensions_capture_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _table(monkeypatch, _here("refuse", when=("captures_final_layer", "aux_outputs")))
    with pytest.raises(SpecError, match="known vLLM bug here"):  # vllm-native reads aux outputs: refused
        preflight(_spec(tmp_path / "a", DS_CONFIG))
    plan = preflight(_spec(tmp_path / "b", DS_CONFIG, backend="worker-extension"))
    assert plan.bug_warnings == () and plan.aux_warnings == ()
    assert plan.aux_refused == f"known vLLM bug here, https://example.invalid/1; {ALLOW_ENV}=here keeps them"
    allowed = _spec(tmp_path / "c", DS_CONFIG, backend="worker-extension", env={ALLOW_ENV: "here"})
    plan = preflight(allowed)
    assert plan.aux_refused is None and "capturing anyway" in plan.aux_warnings[0]
    not_final = _spec(tmp_path / "d", DS_CONFIG, backend="worker-extension", layers=[2, 4])
    assert preflight(not_final).aux_refused is None


def test_an_aux_refusal_names_each_bug_and_link_and_the_setting_that_keeps_the_aux_path() -> None:
    """The reason a worker extension falls back to its hooks stays one short clause: no advice text."""
    bugs = parse_bugs(
        {
            "bug": [
                {
                    "id": "a",
                    "severity": "refuse",
                    "message": "a long story " * 20,
                    "link": "https://x.invalid/a",
                },
                {
                    "id": "w",
                    "severity": "warning",
                    "message": "only a warning",
                    "link": "https://x.invalid/w",
                },
                {"id": "b", "severity": "refuse", "message": "another", "link": "https://x.invalid/b"},
            ]
        }
    )
    target = Target("0.20.0", DSV3, "worker-extension", FINAL_AUX)
    assert aux_refusal(bugs, target, frozenset()) == (
        "known vLLM bug a, https://x.invalid/a; known vLLM bug b, https://x.invalid/b; "
        f"{ALLOW_ENV}=a,b keeps them"
    )
    assert aux_refusal(bugs, target, frozenset({"a"})) == (
        f"known vLLM bug b, https://x.invalid/b; {ALLOW_ENV}=b keeps them"
    )
    assert aux_refusal(bugs, target, frozenset({"a", "b"})) is None
    # the real table: the DeepSeek-V2 final-layer drop on vLLM 0.20's aux path
    hooks = Target("0.20.0", DSV3, "worker-extension", FINAL)  # as the preflight sees it, before the choice
    real = aux_refusal(aux_path_bugs(BUGS, hooks), target, frozenset())
    assert real is not None and real.startswith("known vLLM bug deepseek-v2-final-layer-drop, https://")
    assert real.endswith(f"{ALLOW_ENV}=deepseek-v2-final-layer-drop keeps them")
    assert "Use a fixed vLLM" not in real and "before 0.25.0" not in real  # no advice, no story
