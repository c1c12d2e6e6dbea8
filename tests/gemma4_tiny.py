"""Tiny Gemma4 configs for tests: together they switch on every trait of the Gemma4 text decoder."""

from __future__ import annotations

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def tiny_config(**overrides) -> Gemma4TextConfig:
    """Every trait on: sliding window 8, KV sharing (last 2 layers), k_eq_v, PLE, head_dim 16/32, softcap."""
    kwargs = dict(
        vocab_size=256,
        vocab_size_per_layer_input=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=list(LAYER_TYPES),
        sliding_window=8,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    kwargs.update(overrides)
    return Gemma4TextConfig(**kwargs)


CONFIGS = {
    "all_traits": {},
    "no_ple_no_share_kv": dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=False, num_global_key_value_heads=None),
    "k_eq_v_off_shared": dict(attention_k_eq_v=False, num_global_key_value_heads=None, use_double_wide_mlp=False),
    "mha_same_head_dim": dict(num_key_value_heads=4, global_head_dim=16, num_global_key_value_heads=None, attention_k_eq_v=False, num_kv_shared_layers=0, final_logit_softcapping=None),
}


def tiny_model(config: Gemma4TextConfig, seed: int = 0) -> Gemma4ForCausalLM:
    """A random model whose norms, layer scalars and gates are perturbed away from their init (1s),
    so that a static twin that forgot one of them fails parity."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    return perturbed(Gemma4ForCausalLM(config).eval())


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a Gemma4 text model or a drafter around one) with its norms, matrices and layer scalars moved away
    from their init, in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(0.5).add_(torch.rand_like(p))
            elif p.dim() == 2:
                p.mul_(2.0)  # larger than the 0.02 init so that logits spread and argmax ties are rare
        for layer in model.model.layers:
            layer.layer_scalar.fill_(float(torch.empty(1).uniform_(0.5, 1.5)))
    return model
