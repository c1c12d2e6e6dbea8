"""A tiny multimodal Gemma 4 for tests: the text decoder of `gemma4_tiny` beside a small vision tower with every trait
of the published one on (clipped linears, standardization, GQA-capable attention, axial RoPE, 3x3 pooling)."""

from __future__ import annotations

import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

from tests.gemma4_tiny import perturbed, tiny_config

# Placeholder ids inside the tiny text vocabulary (256): the published ids (255999, 258880, 258882) are past it.
IMAGE_TOKEN_ID, BOI_TOKEN_ID, EOI_TOKEN_ID = 250, 251, 252


def tiny_vision_config(**overrides) -> Gemma4VisionConfig:
    """Two layers of width 32, 4 query heads on 2 KV heads of 8, the published patch (16) and pooling (3) sizes."""
    kwargs = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=16,
        pooling_kernel_size=3,
        position_embedding_size=4096,
        use_clipped_linears=True,
        standardize=True,
    )
    kwargs.update(overrides)
    return Gemma4VisionConfig(**kwargs)


def tiny_multimodal_config(vision: dict | None = None, **text) -> Gemma4Config:
    return Gemma4Config(
        text_config=tiny_config(**text),
        vision_config=tiny_vision_config(**(vision or {})),
        audio_config=None,
        image_token_id=IMAGE_TOKEN_ID,
        boi_token_id=BOI_TOKEN_ID,
        eoi_token_id=EOI_TOKEN_ID,
    )


def tiny_multimodal_model(config: Gemma4Config | None = None, seed: int = 0) -> Gemma4ForConditionalGeneration:
    """A random model, its text decoder perturbed as `gemma4_tiny.tiny_model` does, and its vision tower's clip
    ranges, standardization and norms moved off their defaults (infinite ranges, zero bias, ones), so a twin that
    forgets one fails parity."""
    config = config or tiny_multimodal_config()
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    for sub in (config.get_text_config(), config.vision_config):
        sub._attn_implementation = "eager"
    model = Gemma4ForConditionalGeneration(config).eval()
    holder = torch.nn.Module()  # `perturbed` reads a text model's layers as `.model.layers`
    holder.model = model.model.language_model
    perturbed(holder)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.model.vision_tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-float(torch.empty(1).uniform_(2.0, 4.0, generator=g)))
            elif name.endswith(("input_max", "output_max")):
                b.fill_(float(torch.empty(1).uniform_(2.0, 4.0, generator=g)))
            elif name.endswith("std_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
            elif name.endswith("std_scale"):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
        for name, p in model.model.vision_tower.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(0.5).add_(torch.rand(p.shape, generator=g))
            elif name.endswith("position_embedding_table"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model
