"""Build a tiny random-weight model offline (Llama or DeepSeek-V3/MLA) with a locally built tokenizer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

VOCAB_WORDS = 500
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def llama_config() -> dict[str, Any]:
    """Config keys of the tiny Llama: hidden 128, 8 layers, GQA."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def deepseek_v3_config() -> dict[str, Any]:
    """Config keys of the tiny DeepSeek-V3; the CPU MLA kernel needs kv_lora_rank 512 + rope dim 64."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    }


def _tokenizer(out: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer over 'w0'..'wN' words (whitespace split), saved as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(vocab_size - len(SPECIALS)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(out))


def build(
    out_dir: str | Path,
    arch: str,
    seed: int = 0,
    dtype: str = "float32",
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write config.json, random weights (fixed seed) and a tokenizer into out_dir; returns the path.

    overrides replace config keys, e.g. DeepSeek's real MLA head dims (qk_nope/v 128) that vLLM's GPU MLA
    prefill kernels require.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = {"llama": llama_config, "deepseek_v3": deepseek_v3_config}[arch]()
    base.update(
        {
            "vocab_size": VOCAB_WORDS,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 3,
            "torch_dtype": dtype,
            **(overrides or {}),
        }
    )
    model_type = base.pop("model_type")
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, dtype))
    with torch.no_grad():
        # init_weights leaves some tensors (e.g. the router bias) at zero or ones: randomise everything
        # a little so that every layer actually changes the residual stream.
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out), safe_serialization=True)
    _tokenizer(out, VOCAB_WORDS)
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("architectures", base["architectures"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv: list[str]) -> int:
    """`tiny-model DIR --arch llama|deepseek_v3 [--seed N] [--dtype float32|bfloat16]`."""
    p = argparse.ArgumentParser(prog="eaglewatch-agent tiny-model", description=main.__doc__)
    p.add_argument("dir")
    p.add_argument("--arch", choices=["llama", "deepseek_v3"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = p.parse_args(argv)
    out = build(args.dir, args.arch, seed=args.seed, dtype=args.dtype)
    print(f"tiny {args.arch} model written to {out}", flush=True)
    return 0
