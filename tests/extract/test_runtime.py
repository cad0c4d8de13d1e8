"""The job's engine decisions as case tables: version gate, runner, capture path, CPU-engine defaults."""

from __future__ import annotations

import pytest

from agent import settings
from agent.extract.capture.aux_capture import aux_plan, env_value
from agent.extract.engine.runtime import (
    CaptureConflict,
    UnsupportedVersion,
    check_version,
    choose_capture,
    choose_runner,
    cpu_defaults,
    flag,
    is_moe,
    parse_version,
    thread_binding,
)

ALLOW_UNTESTED_ENV = "EAGLEWATCH_ALLOW_UNTESTED_VLLM"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("0.26.0", (0, 26, 0)),
        ("0.32.0+cpu", (0, 32, 0)),
        ("0.26.1rc2", (0, 26, 1)),
        ("0.20", (0, 20, 0)),
        ("dev", None),
    ],
)
def test_parse_version(text: str, want: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == want


@pytest.mark.parametrize(
    ("version", "env", "want"),
    [
        ("0.20.0", {}, None),
        ("0.26.0", {}, None),
        ("0.32.0", {}, None),
        ("0.32.0+cpu", {}, None),
        ("0.22.1", {}, "inside the checked range 0.20 – 0.33 but untested"),
        ("0.34.0", {ALLOW_UNTESTED_ENV: "1"}, "outside the checked range 0.20 – 0.33; capturing anyway"),
    ],
)
def test_version_gate_warns(version: str, env: dict[str, str], want: str | None) -> None:
    note = check_version(version, env)
    assert note == want if want is None else want in (note or "")


@pytest.mark.parametrize("version", ["0.19.1", "0.34.0", "1.0.0", "unknown"])
def test_version_gate_refuses_untested_majors(version: str) -> None:
    with pytest.raises(UnsupportedVersion, match=rf"vLLM {version} is outside .* {ALLOW_UNTESTED_ENV}=1"):
        check_version(version, {ALLOW_UNTESTED_ENV: "0"})


LLAMA, DSV2, DSV3 = ["LlamaForCausalLM"], ["DeepseekV2ForCausalLM"], ["DeepseekV3ForCausalLM"]


@pytest.mark.parametrize(
    ("backend", "version", "platform", "archs", "moe", "user", "runner", "forced"),
    [
        # the user's setting wins, whatever the rest
        ("worker-extension", (0, 26, 0), "cuda", LLAMA, False, False, "v1", {}),
        ("vllm-native", (0, 26, 0), "cuda", LLAMA, False, True, "v2", {}),
        ("worker-extension", (0, 32, 0), "cpu", LLAMA, False, None, "v1", {}),
        ("worker-extension", (0, 24, 0), "cuda", LLAMA, False, None, "v1", {}),
        # V2 is vLLM's default from 0.25; the extension supports it, so nothing is forced
        ("worker-extension", (0, 26, 0), "cuda", LLAMA, False, None, "v2", {}),
        ("worker-extension", (0, 26, 0), "cuda", DSV2, True, None, "v2", {}),
        ("worker-extension", (0, 26, 0), "cuda", DSV3, True, None, "v1", {}),
        # only V1 runs extract_hidden_states before 0.32: selected, and said so
        ("vllm-native", (0, 26, 0), "cuda", LLAMA, False, None, "v1", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        ("vllm-native", (0, 32, 0), "cuda", LLAMA, False, None, "v2", {}),
    ],
)
def test_choose_runner(
    backend: str,
    version: tuple[int, int, int],
    platform: str,
    archs: list[str],
    moe: bool,
    user: bool | None,
    runner: str,
    forced: dict[str, str],
) -> None:
    choice = choose_runner(backend, version, platform, archs, moe, user)
    assert (choice.runner, choice.set_env) == (runner, forced)
    assert ("your setting" in choice.reason) == (user is not None)


def test_runner_flag_values() -> None:
    assert [flag(v) for v in (None, "", "1", "true", "0", "False")] == [None, None, True, True, False, False]
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER='maybe' is neither"):
        flag("maybe")


def test_is_moe() -> None:
    assert is_moe({"n_routed_experts": 8}) and is_moe({"num_local_experts": 4})
    assert not is_moe({"hidden_size": 128}) and not is_moe({"num_experts": 1})


@pytest.mark.parametrize(
    ("cpus", "tp", "want"),
    [
        ([0, 1], 2, "0|1"),
        (list(range(8)), 2, "0-3|4-7"),
        ([4, 2, 3, 5], 2, "2-3|4-5"),
        (list(range(5)), 2, "0-1|2-3"),  # a spare CPU stays unbound rather than unevenly shared
        # fewer CPUs than ranks: round-robin, one CPU per rank, in CPU order
        ([0, 1], 4, "0|1|0|1"),
        ([0, 1], 8, "0|1|0|1|0|1|0|1"),
        ([7, 3, 5], 4, "3|5|7|3"),
        ([6], 2, "6|6"),
    ],
)
def test_thread_binding(cpus: list[int], tp: int, want: str) -> None:
    assert thread_binding(cpus, tp) == want


GIB = 1 << 30


def test_cpu_defaults_fill_what_the_user_left_unset() -> None:
    got = cpu_defaults({}, [], 2, [0, 1], {"avx2"}, 20 * GIB, "bfloat16")
    assert got.env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert got.args == ["--dtype", "float32"]
    assert set(got.reasons) == {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "--dtype"}


@pytest.mark.parametrize(
    ("env", "tp", "cpus", "bind", "warned"),
    [
        ({}, 8, [0, 1], "0|1|0|1|0|1|0|1", True),
        ({}, 4, [2, 3], "2|3|2|3", True),
        ({}, 2, [0, 1], "0|1", False),
        ({}, 1, [0], None, False),
        # the user's own binding wins, from the spec's env or the job's (an empty value counts as unset)
        ({"VLLM_CPU_OMP_THREADS_BIND": "0|0|1|1|0|0|1|1"}, 8, [0, 1], None, False),
        ({"VLLM_CPU_OMP_THREADS_BIND": ""}, 4, [0, 1], "0|1|0|1", True),
    ],
)
def test_cpu_defaults_bind_more_ranks_than_cpus_round_robin_and_warn(
    env: dict[str, str], tp: int, cpus: list[int], bind: str | None, warned: bool
) -> None:
    got = cpu_defaults(env, [], tp, cpus, {"avx2"}, 20 * GIB, "float32")
    assert got.env.get("VLLM_CPU_OMP_THREADS_BIND") == bind
    assert ("round-robin" in got.reasons.get("VLLM_CPU_OMP_THREADS_BIND", "")) == warned
    if warned:
        assert got.warnings == [
            f"tensor_parallel_size {tp} on {len(cpus)} CPUs: ranks share CPUs "
            f"(VLLM_CPU_OMP_THREADS_BIND={bind}) and run slower than on {tp}; "
            "set VLLM_CPU_OMP_THREADS_BIND in the spec's env to bind them yourself"
        ]
    else:
        assert got.warnings == []
    assert got.env["VLLM_CPU_KVCACHE_SPACE"] == ("1" if tp >= 4 else str(int(4 / tp)))


def test_cpu_defaults_user_settings_win() -> None:
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    got = cpu_defaults(env, ["--dtype=bfloat16"], 2, [0, 1], set(), 20 * GIB, "bfloat16")
    assert (got.env, got.args, got.reasons) == ({}, [], {})


def test_cpu_defaults_keep_bf16_where_the_cpu_has_it_and_tp1_needs_no_binding() -> None:
    got = cpu_defaults({}, [], 1, [0, 1], {"avx512_bf16"}, 2 * GIB, "bfloat16")
    assert got.env == {"VLLM_CPU_KVCACHE_SPACE": "1"} and got.args == []


@pytest.mark.parametrize(
    ("backend", "platform", "args", "env", "path", "compiled", "v1"),
    [
        # the default on a GPU: CUDA graphs stay on, the states come from the compiled model's aux outputs
        ("worker-extension", "cuda", [], {}, "aux", True, True),
        # off the GPU, or eager by the user's own flag: layer hooks, either runner
        ("worker-extension", "cpu", [], {}, "hooks", False, False),
        ("worker-extension", "cuda", ["--enforce-eager"], {}, "hooks", False, False),
        # the user's V2 runner wins over graphs: hooks, eager
        ("worker-extension", "cuda", [], {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "hooks", False, False),
        # the user's own capture setting wins
        ("worker-extension", "cuda", [], {"EAGLEWATCH_CAPTURE": "hooks"}, "hooks", False, False),
        ("worker-extension", "cpu", [], {"EAGLEWATCH_CAPTURE": "aux"}, "aux", True, True),  # CPU compiles
        ("worker-extension", "cuda", ["--enforce-eager"], {"EAGLEWATCH_CAPTURE": "AUX"}, "aux", False, True),
        ("vllm-native", "cuda", [], {}, "native", True, False),
        ("vllm-native", "cuda", ["--enforce-eager"], {}, "native", False, False),
        ("vllm-native", "cpu", [], {}, "native", False, False),
    ],
)
def test_choose_capture(
    backend: str, platform: str, args: list[str], env: dict[str, str], path: str, compiled: bool, v1: bool
) -> None:
    got = choose_capture(backend, platform, args, env)
    assert (got.path, got.compiled, got.needs_v1) == (path, compiled, v1)
    # a compiled aux capture must never load a model compiled without its aux outputs from vLLM's cache
    want_env = {"VLLM_DISABLE_COMPILE_CACHE": "1"} if path == "aux" and compiled else {}
    assert got.set_env == want_env
    assert ("your setting" in got.reason) == bool(
        env.get("EAGLEWATCH_CAPTURE") or env.get("VLLM_USE_V2_MODEL_RUNNER") or args
    )


def test_capture_settings_that_cannot_both_hold() -> None:
    with pytest.raises(
        CaptureConflict, match=r"EAGLEWATCH_CAPTURE=aux reads .* V1 .* VLLM_USE_V2_MODEL_RUNNER=1"
    ):
        choose_capture(
            "worker-extension", "cuda", [], {"EAGLEWATCH_CAPTURE": "aux", "VLLM_USE_V2_MODEL_RUNNER": "1"}
        )
    with pytest.raises(
        CaptureConflict, match="VLLM_DISABLE_COMPILE_CACHE=0 would let vLLM load a model compiled"
    ):
        choose_capture("worker-extension", "cuda", [], {"VLLM_DISABLE_COMPILE_CACHE": "0"})
    # eager aux compiles nothing: the cache setting does not matter
    eager = ["--enforce-eager"]
    env = {"EAGLEWATCH_CAPTURE": "aux", "VLLM_DISABLE_COMPILE_CACHE": "0"}
    assert choose_capture("worker-extension", "cuda", eager, env).set_env == {}
    with pytest.raises(CaptureConflict, match="EAGLEWATCH_CAPTURE='graphs': expected one of aux, hooks"):
        choose_capture("worker-extension", "cuda", [], {"EAGLEWATCH_CAPTURE": "graphs"})


def test_a_known_aux_output_bug_sends_the_worker_extension_to_its_hooks() -> None:
    why = (
        "known vLLM bug deepseek-v2-final-layer-drop, https://github.com/vllm-project/vllm/issues/48124; "
        "EAGLEWATCH_ALLOW_KNOWN_BUGS=deepseek-v2-final-layer-drop keeps them"
    )
    got = choose_capture("worker-extension", "cuda", [], {}, why)
    assert (got.path, got.compiled, got.needs_v1, got.set_env) == ("hooks", False, False, {})
    assert (
        got.reason.startswith("eager, Python layer hooks: the aux outputs would be wrong")
        and why in got.reason
    )
    with pytest.raises(
        CaptureConflict, match=r"EAGLEWATCH_CAPTURE=aux \(your setting\) reads vLLM's aux .*48124"
    ):
        choose_capture("worker-extension", "cuda", [], {"EAGLEWATCH_CAPTURE": "aux"}, why)
    # paths that never read the worker extension's aux outputs are as before
    assert choose_capture("worker-extension", "cuda", ["--enforce-eager"], {}, why).reason == (
        "--enforce-eager (your setting): Python layer hooks"
    )
    assert choose_capture("worker-extension", "cpu", [], {}, why).path == "hooks"


def test_aux_capture_selects_v1_on_gpu_and_says_why() -> None:
    aux = choose_capture("worker-extension", "cuda", [], {})
    choice = choose_runner("worker-extension", (0, 26, 0), "cuda", LLAMA, False, None, aux)
    assert (choice.runner, choice.set_env) == ("v1", {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert "aux hidden-state outputs" in choice.reason
    # the user's runner setting still wins (choose_capture then picks hooks, or refuses an explicit aux)
    assert choose_runner("worker-extension", (0, 26, 0), "cuda", LLAMA, False, False, aux).set_env == {}


@pytest.mark.parametrize(
    ("layers", "convention", "want_aux", "want_slots"),
    [
        ([2, 4, 5, 8], "input", (2, 4, 5, 8), [0, 1, 2, 3]),  # input k is aux k, N the last layer's output
        ([1, 3, 7], "output", (2, 4, 8), [0, 1, 2]),  # output k is the input of k + 1
        ([8, 2, 2], "input", (2, 8), [1, 0, 0]),  # any order, repeats: one aux output each, slots kept
        ([0], "input", (0,), [0]),  # the embeddings
    ],
)
def test_aux_plan(
    layers: list[int], convention: str, want_aux: tuple[int, ...], want_slots: list[int]
) -> None:
    assert aux_plan(layers, convention, 8) == (want_aux, want_slots)
    assert env_value(layers, convention, 8) == ",".join(map(str, want_aux))
    assert settings.AUX_LAYERS.get({"EAGLEWATCH_AUX_LAYERS": env_value(layers, convention, 8)}) == want_aux


def test_aux_plan_and_env_errors() -> None:
    with pytest.raises(ValueError, match=r"layer id 9 out of range 0..8 \(convention input\)"):
        aux_plan([9], "input", 8)
    with pytest.raises(ValueError, match=r"layer id 8 out of range 0..7 \(convention output\)"):
        aux_plan([8], "output", 8)
    assert (
        settings.AUX_LAYERS.get({}) is None
        and settings.AUX_LAYERS.get({"EAGLEWATCH_AUX_LAYERS": " "}) is None
    )
    with pytest.raises(ValueError, match="EAGLEWATCH_AUX_LAYERS='2,x': expected comma-separated"):
        settings.AUX_LAYERS.get({"EAGLEWATCH_AUX_LAYERS": "2,x"})
