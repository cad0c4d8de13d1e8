"""Pure rules for the torch-saved capture formats: old speculators and Model-Optimizer .pt, SpecForge and
EAGLE ge_data .ckpt."""

from __future__ import annotations

from agent.checks.dirs import family
from agent.checks.shapes import (
    MLA_LATENT_HINT,
    Described,
    Expectation,
    Problem,
    TensorMeta,
    check_layer_list,
    check_mask,
    dims,
    float_check,
    missing_keys,
    squeeze_batch,
    token_count,
    width_mismatch,
)

SPECULATORS_PT = "speculators-pt"
SPECFORGE = "specforge-ckpt"
#: NVIDIA Model-Optimizer's examples/speculative_decoding compute_hidden_states_{hf,vllm,trtllm}.py: one
#: {conversation_id}.pt per conversation
MODELOPT = "modelopt-pt"
#: The fused auxiliary layers of an EAGLE-3 capture when no layer count is given: SpecForge's
#: aux_hidden_state (scripts/prepare_hidden_states.py) and Model-Optimizer's aux_hidden_states (its default
#: --aux-layers eagle) both hold three
EAGLE3_AUX_LAYERS = 3
EAGLE = "eagle-ckpt"
SAFETENSORS = "safetensors"

REQUIRED = {
    SPECULATORS_PT: ("input_ids", "hidden_states", "loss_mask"),
    SPECFORGE: ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state"),
    EAGLE: ("input_ids", "hidden_state", "loss_mask"),
    # loss_mask is optional: Model-Optimizer's offline loader takes a file without one (all tokens count)
    MODELOPT: ("input_ids", "hidden_states", "aux_hidden_states"),
}
#: (the last layer's key, the fused auxiliary layers' key or None) of the formats that keep them apart
SPLIT_KEYS: dict[str, tuple[str, str | None]] = {
    SPECFORGE: ("hidden_state", "aux_hidden_state"),
    EAGLE: ("hidden_state", None),
    MODELOPT: ("hidden_states", "aux_hidden_states"),
}


def classify(name: str, keys: set[str]) -> str:
    """Which torch format a loaded dict is: by its keys first, then by the file name."""
    if "aux_hidden_states" in keys:
        return MODELOPT
    if "aux_hidden_state" in keys:
        return SPECFORGE
    if "hidden_state" in keys:
        return EAGLE
    # old speculators numbered its files data_N.pt; Model-Optimizer names them after the conversation
    if name.endswith(".pt") and family(name) is None:
        return MODELOPT
    return SPECULATORS_PT if "hidden_states" in keys or name.endswith(".pt") else SPECFORGE


def _tensor(file: str, key: str, value: Described) -> tuple[TensorMeta | None, list[Problem]]:
    if isinstance(value, TensorMeta):
        return value, []
    got = f"a list of {len(value)}" if isinstance(value, list) else f"a {value}"
    return None, [
        Problem(
            "hidden_dim_lost" if "hidden" in key else "missing_key",
            file,
            f"{key} is {got}, expected a tensor",
        )
    ]


def check_sample(file: str, fmt: str, sample: dict[str, Described], expect: Expectation) -> list[Problem]:
    """Check one loaded torch-format sample (its tensors described by shape and dtype) against expect."""
    problems = missing_keys(file, sample, REQUIRED[fmt])
    t: int | None = None
    if "input_ids" in sample:
        ids, p = _tensor(file, "input_ids", sample["input_ids"])
        problems += p
        if ids is not None:
            t, p = token_count(file, "input_ids", ids.shape, ids.dtype)
            problems += p
    if "loss_mask" in sample:
        mask, p = _tensor(file, "loss_mask", sample["loss_mask"])
        problems += p if mask is None else check_mask(file, mask, t)
    if fmt == SPECULATORS_PT and "hidden_states" in sample:
        hs = sample["hidden_states"]
        if isinstance(hs, TensorMeta):
            # a stacked [layers, T, hidden] tensor is the same data as the list the format specifies
            items = [TensorMeta(hs.shape[1:], hs.dtype)] * hs.shape[0] if len(hs.shape) == 3 else [hs]
        elif isinstance(hs, list):
            items = hs
        else:
            return [
                *problems,
                Problem("hidden_dim_lost", file, f"hidden_states is a {hs}, expected a list of tensors"),
            ]
        problems += check_layer_list(file, "hidden_states", items, t, expect)
    elif fmt in SPLIT_KEYS:
        problems += _check_single_and_aux(file, fmt, sample, t, expect)
    return problems


def _matrix(
    file: str, key: str, meta: TensorMeta, t: int | None, want: str, last: bool
) -> tuple[tuple[int, ...] | None, list[Problem]]:
    """``key``'s [T, width] shape (a batch axis of 1 dropped), or None when it has not two axes; ``last``: a
    [width, T] last layer counts as a lost hidden dimension too."""
    shape = squeeze_batch(meta.shape)
    if len(shape) < 2 or (last and len(shape) == 2 and t is not None and shape[-1] == t and shape[0] != t):
        msg = f"hidden dimension lost: {key} is {dims(meta.shape)}, expected {want}"
        return None, [Problem("hidden_dim_lost", file, msg)]
    if len(shape) != 2:
        return None, [Problem("layer_count_mismatch", file, f"{key} is {dims(meta.shape)}, expected {want}")]
    if t is not None and shape[0] != t:
        return shape, [
            Problem("seq_len_mismatch", file, f"{key} has {shape[0]} tokens but input_ids has {t}")
        ]
    return shape, []


def _check_single_and_aux(
    file: str, fmt: str, sample: dict[str, Described], t: int | None, expect: Expectation
) -> list[Problem]:
    problems: list[Problem] = []
    hidden = expect.hidden_size
    last_key, aux_key = SPLIT_KEYS[fmt]
    if last_key in sample:
        last, p = _tensor(file, last_key, sample[last_key])
        problems += p
        if last is not None:
            problems += float_check(file, last_key, last.dtype)
            want = f"[{t if t is not None else 'T'}, {expect.hidden_size or 'hidden'}]"
            shape, p = _matrix(file, last_key, last, t, want, last=True)
            problems += p
            if shape is not None and expect.hidden_size is not None and shape[1] != expect.hidden_size:
                problems.append(
                    Problem("hidden_size_mismatch", file, width_mismatch(last_key, shape[1], expect))
                )
            hidden = hidden or (shape[1] if shape is not None else None)
    if aux_key is None or aux_key not in sample:
        return problems
    aux, p = _tensor(file, aux_key, sample[aux_key])
    if aux is None:
        return problems + p
    # no layer count given: both formats capture EAGLE-3's three auxiliary layers by default
    want_aux = EAGLE3_AUX_LAYERS if expect.layers is None else expect.layers - 1
    # Model-Optimizer's vLLM dump writes torch.empty(0) when it kept no auxiliary layer
    if aux.shape == (0,):
        return [
            *problems,
            Problem(
                "layer_count_mismatch",
                file,
                f"layer count mismatch: {aux_key} is empty ({dims(aux.shape)}): no auxiliary layer captured, "
                f"expected {want_aux}",
            ),
        ]
    problems += float_check(file, aux_key, aux.dtype)
    want = f"[{t if t is not None else 'T'}, {want_aux or 'k'} × {hidden or 'hidden'}]"
    shape, p = _matrix(file, aux_key, aux, t, want, last=False)
    problems += p
    if shape is None:
        return problems
    if hidden:
        if shape[1] % hidden:
            rank = expect.kv_lora_rank
            latent = (
                f" but of the model's kv_lora_rank {rank}: {MLA_LATENT_HINT}"
                if rank and shape[1] % rank == 0
                else ""
            )
            problems.append(
                Problem(
                    "hidden_size_mismatch",
                    file,
                    f"hidden size mismatch: {aux_key}'s last axis {shape[1]} "
                    f"is not a multiple of {hidden}{latent}",
                )
            )
        elif shape[1] // hidden != want_aux:
            k = shape[1] // hidden
            problems.append(
                Problem(
                    "layer_count_mismatch",
                    file,
                    f"layer count mismatch: {aux_key} has {k} layers ({shape[1]} = {k} × {hidden}), "
                    f"expected {want_aux} (+ {last_key} as layer {want_aux + 1})",
                )
            )
    return problems
