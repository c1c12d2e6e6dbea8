"""Does an offline rotation help Gemma4's 4-bit weights? Weight-only fake quantization, rotation on and off.

Rotations (QuaRot, SpinQuant) spread a channel's outliers over many channels before rounding, and fold into the
weights only where nothing between two linears depends on the basis. In a Gemma4 decoder layer:

- R1, the residual stream (rotate the embeddings and every linear that reads or writes the residual): does not
  fold. Gemma4 normalises *after* attention, the MLP and the per-layer-input projection (post_attention_layernorm,
  post_feedforward_layernorm, post_per_layer_input_norm) and adds the normalised output to the residual. The norm's
  weight multiplies channel by channel in the unrotated basis, and it sits between the linear and the residual, so it
  cannot be absorbed into either (Llama's pre-norm-only layers absorb it into the next linear).
- R2, values to o_proj, per head: folds where the layer has its own v_proj. `v_norm` has no weight (an RMS norm
  over head_dim, which an orthogonal matrix preserves), attention mixes tokens, not channels, so rotating v_proj's
  output rows of each head and o_proj's input columns by the same matrix leaves the layer's output equal. It does
  not fold on full-attention layers with `attention_k_eq_v` (V is the raw key projection, which k_norm's weight and
  RoPE then use in the unrotated basis), and a KV-reusing layer rotates its o_proj as its source layer's V was.
- R3 (queries and keys after RoPE) and R4 (the down projection's input) need a rotation computed at run time: an
  extra HTP op per layer. Between gate/up and down_proj only a diagonal scale folds (the GELU product is channel-wise).

This script measures R2 (a random-sign Hadamard of head_dim): logits SQNR, top-1 and perplexity against fp32 over
held-out text, every HTP linear at 4 bits in LPBQ blocks of 64 rounded as the quantizer rounds, activations float.

Usage: python benchmarks/rotation.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn

from optimum_qnn.metrics import sqnr_db

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

BLOCK = 64
CONTEXT, WINDOWS = 128, 8


def hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal `n x n` Hadamard matrix (Sylvester, n a power of 2) with random column signs."""
    if n & (n - 1):
        raise ValueError(f"head_dim {n} is not a power of 2")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return h * signs / math.sqrt(n)


def rotate_values(model: nn.Module) -> list[int]:
    """Apply R2 where it folds (module docstring); returns the indices of the layers whose o_proj was rotated."""
    layers = model.model.layers
    config = model.config
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    source = {}  # layer type -> index of the last cache-owning layer of that type
    rotated = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        kind = config.layer_types[i]
        if i < first_shared:
            source[kind] = i
        src = layers[source[kind]].self_attn
        if src.v_proj is None:
            continue
        hd = attn.head_dim
        r = hadamard(hd)
        with torch.no_grad():
            if i < first_shared:
                w = attn.v_proj.weight.double().reshape(-1, hd, attn.v_proj.in_features)
                attn.v_proj.weight.copy_(torch.einsum("dk,hdi->hki", r, w).reshape(attn.v_proj.weight.shape))
            w = attn.o_proj.weight.double().reshape(attn.o_proj.out_features, -1, hd)
            attn.o_proj.weight.copy_(torch.einsum("ohd,dk->ohk", w, r).reshape(attn.o_proj.weight.shape))
        rotated.append(i)
    return rotated


def quantize_linears(model: nn.Module) -> None:
    from optimum_qnn.quantization.weight_search import block_of, fake_quantize_weight

    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and "embed" not in name:
                m.weight.copy_(fake_quantize_weight(m.weight, 4, block_of(m, BLOCK)))


def logits(model: nn.Module, windows: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=w.unsqueeze(0)).logits[0].double() for w in windows])


def score(got: torch.Tensor, ref: torch.Tensor, windows: list[torch.Tensor]) -> dict[str, float]:
    targets = torch.cat([w[1:] for w in windows])
    keep = torch.cat([torch.arange(w.numel() - 1) + sum(v.numel() for v in windows[:i]) for i, w in enumerate(windows)])
    return {
        "SQNR dB": sqnr_db(got, ref),
        "top-1": (got[keep].argmax(-1) == ref[keep].argmax(-1)).double().mean().item(),
        "PPL": math.exp(nn.functional.cross_entropy(got[keep], targets).item()),
    }


def measure(model_dir: Path) -> list[tuple[str, dict[str, float]]]:
    from transformers import AutoTokenizer

    import recipe
    from optimum_qnn.models.gemma4.loading import load_text_model

    from optimum_qnn.exporter.evaluation import windows as cut

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(recipe.held_out_text(), add_special_tokens=False)["input_ids"]
    windows = cut(ids, CONTEXT, tok.bos_token_id, max_tokens=WINDOWS * (CONTEXT - 1))
    rows = []
    ref = None
    for label, rotate, quantize in (("fp32", False, False), ("fp32, R2 rotated", True, False),
                                    ("4-bit", False, True), ("4-bit, R2 rotated", True, True)):
        model = load_text_model(model_dir)[0].float().eval()
        if rotate:
            rotated = rotate_values(model)
            label += f" (layers {','.join(map(str, rotated))})"
        if quantize:
            quantize_linears(model)
        out = logits(model, windows)
        ref = out if ref is None else ref
        rows.append((label, score(out, ref, windows)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    args = parser.parse_args()
    print("| model | weights | logits SQNR dB | top-1 | PPL |\n|---|---|---|---|---|")
    for model_dir in args.models:
        for label, s in measure(model_dir):
            print(f"| {model_dir.name} | {label} | {s['SQNR dB']:.2f} | {s['top-1']:.3f} | {s['PPL']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
