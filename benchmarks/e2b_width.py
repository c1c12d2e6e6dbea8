"""A Gemma4 text checkpoint with Gemma-4-E2B's real widths and random weights, at reduced depth.

E2B (published config): 35 layers (4 sliding + 1 full, repeated; window 512), the last 20 reuse the KV of an
earlier layer, hidden 1536, 8 query heads, 1 KV head, head_dim 256 sliding / 512 full with partial RoPE,
MLP 6144 (12288 in the KV-reusing layers), vocab 262144, per-layer embeddings of 256 per layer, softcap 30.
`e2b_config(depth, reuse)` keeps every width and the layer pattern and cuts the depth (the last layer is full, as
in E2B): the first `depth - reuse` layers own a KV cache, the last `reuse` layers reuse one. Depth 7 with 2 reusing
layers has sliding and full layers of both kinds.

The weights are stored in bfloat16, as the real checkpoint's are, and written tensor by tensor from a meta-device
model, so building one never holds an fp32 copy of the 262144-row tables.

Usage: python benchmarks/e2b_width.py OUT_DIR --depth 7 --reuse 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from optimum_qnn.exporter.parameters import ParameterCounts

E2B_LAYERS, E2B_REUSE = 35, 20
E4B_LAYERS, E4B_REUSE = 42, 18
RECIPE_VERSION = 1


def e2b_config(depth: int = E2B_LAYERS, reuse: int = E2B_REUSE) -> Gemma4TextConfig:
    """Gemma-4-E2B's text config with `depth` layers, the last `reuse` of which reuse an earlier layer's KV."""
    return _config(depth, reuse, hidden=1536, mlp=6144, kv_heads=1, sliding_per_full=4, double_wide_mlp=True)


def e4b_config() -> Gemma4TextConfig:
    """Gemma-4-E4B's text config as published (google/gemma-4-e4b's `text_config`): 42 layers in groups of 5 sliding
    + 1 full, the last 18 reusing an earlier layer's KV, hidden 2560, 8 query heads, 2 KV heads, head_dim 256 sliding
    / 512 full with partial RoPE, one MLP width (10240) in every layer; vocabulary, window, per-layer embeddings of
    256 per layer, RoPE and softcap as E2B."""
    return _config(E4B_LAYERS, E4B_REUSE, hidden=2560, mlp=10240, kv_heads=2, sliding_per_full=5, double_wide_mlp=False)


def _config(depth: int, reuse: int, *, hidden: int, mlp: int, kv_heads: int, sliding_per_full: int,
            double_wide_mlp: bool) -> Gemma4TextConfig:
    pattern = ["sliding_attention"] * sliding_per_full + ["full_attention"]
    return Gemma4TextConfig(
        vocab_size=262144,
        vocab_size_per_layer_input=262144,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=depth,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        head_dim=256,
        global_head_dim=512,
        # transformers forces the last layer to full attention (E2B's 35th and E4B's 42nd are full anyway)
        layer_types=[pattern[i % len(pattern)] for i in range(depth - 1)] + ["full_attention"],
        sliding_window=512,
        num_kv_shared_layers=reuse,
        use_double_wide_mlp=double_wide_mlp,
        hidden_size_per_layer_input=256,
        final_logit_softcapping=30.0,
        max_position_embeddings=131072,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def parameter_counts(config: Gemma4TextConfig) -> dict[str, int]:
    """Parameters of the token table, the per-layer embedding table (its width grows with depth), the decoder
    layers, and the rest (norms and the per-layer projection): the exporter's own count (optimum_qnn.exporter.memory)."""
    return ParameterCounts.from_config(config).as_dict()


def depth_parameters(config: Gemma4TextConfig) -> int:
    """The parameters that grow with depth: the decoder layers and the per-layer embedding table."""
    counts = parameter_counts(config)
    return counts["layers"] + counts["per_layer_table"]


def random_weight(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A bf16 tensor as the benchmark checkpoints store it: N(0, 0.02) noise for a matrix, drawn in fp32 one chunk of
    about 16 M values at a time (no fp32 copy of a 262144-row table); ones for a vector (norms, layer scalars)."""
    t = torch.empty(shape, dtype=torch.bfloat16)
    if len(shape) < 2:
        return t.fill_(1.0)
    flat = t.view(shape[0], -1)
    rows = max(1, (1 << 24) // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], rows):
        chunk = torch.randn((min(rows, flat.shape[0] - start), flat.shape[1]), generator=gen)
        flat[start : start + rows] = chunk.mul_(0.02)
    return t


def build(folder: Path, depth: int, reuse: int, seed: int = 0) -> Path:
    """Write (once; cached by recipe) a random-weight E2B-width checkpoint with `depth` layers to `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    stamp = folder / "recipe.json"
    recipe = {"version": RECIPE_VERSION, "depth": depth, "reuse": reuse, "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = e2b_config(depth, reuse)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the token table
        tensors[name] = random_weight(tuple(p.shape), gen)
    config.architectures = ["Gemma4ForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    stamp.write_text(json.dumps(recipe))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--reuse", type=int, default=2)
    args = parser.parse_args()
    print(build(args.out, args.depth, args.reuse))


if __name__ == "__main__":
    main()
