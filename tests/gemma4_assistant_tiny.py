"""Tiny Gemma 4 assistants (MTP drafters) for tests, each fitting a tiny target of ``tests/gemma4_tiny.py``.

The drafter is narrower than its target (32 vs 64), so a twin that mixed up the two widths fails. What ties it to the
target is read from the target's config: the vocabulary, the target's width (``backbone_hidden_size``), the window,
and per attention kind the head_dim and KV heads of the target layers whose K/V it reads.
"""

from __future__ import annotations

import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

from optimum_qnn.models.gemma4.assistant import buildable_assistant_config
from tests.gemma4_tiny import perturbed, tiny_config


def tiny_assistant_config(target=None, *, ordered: bool = False, **text_overrides) -> Gemma4AssistantConfig:
    """A 4-layer drafter (3 sliding, 1 full) for ``target`` (default: ``tiny_config()``); ``ordered`` switches on the
    clustered output embedding (16 clusters, 4 scored)."""
    target = target or tiny_config()
    full = target.per_layer_config[target.layer_types.index("full_attention")]
    sliding = target.per_layer_config[target.layer_types.index("sliding_attention")]
    text = dict(
        vocab_size=target.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=target.num_attention_heads, num_key_value_heads=sliding.num_key_value_heads,
        head_dim=sliding.head_dim, global_head_dim=full.head_dim, num_global_key_value_heads=full.num_key_value_heads,
        attention_k_eq_v=True, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=target.sliding_window, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        max_position_embeddings=target.max_position_embeddings,
    )
    text.update(text_overrides)
    extra = dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4) if ordered else {}
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target.hidden_size, **extra)


def tiny_assistant(config: Gemma4AssistantConfig, seed: int = 0) -> Gemma4AssistantForCausalLM:
    """A random drafter, perturbed as the tiny targets are, with a random token order for ordered embeddings."""
    torch.manual_seed(seed)
    buildable_assistant_config(config)
    config.get_text_config()._attn_implementation = "eager"
    model = perturbed(Gemma4AssistantForCausalLM(config).eval())
    if model.masked_embedding is not None:
        model.masked_embedding.token_ordering.copy_(torch.randperm(config.get_text_config().vocab_size))
    return model
