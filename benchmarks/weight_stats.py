"""How heavy-tailed the HTP linear weights of a checkpoint are, per output channel: what 4-bit rounding fights.

A 4-bit channel (or block) gets 15 levels between its smallest and largest weight. When one weight is far out in
the tail, the step is coarse for all the others. Two statistics per output channel say how far:

- kurtosis: Pearson's, E[(w - mean)^4] / Var(w)^2; a Gaussian has 3, heavier tails more;
- max / mean: max |w| over mean |w|; for a Gaussian it grows slowly with the channel's length (about 3.9 for 384
  weights, 4.6 for 6144), so each class is also compared with Gaussian weights of its own shape.

Usage: python benchmarks/weight_stats.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

# Linear classes in the order of the decoder; the rest of the name (layer index) is dropped.
_CLASS = re.compile(r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|per_layer_input_gate|per_layer_projection|"
                    r"per_layer_model_projection|lm_head)")


def channel_stats(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel of `[out, in]`: (Pearson kurtosis, max |w| / mean |w|)."""
    w = weight.detach().double()
    centred = w - w.mean(1, keepdim=True)
    var = centred.pow(2).mean(1)
    kurtosis = centred.pow(4).mean(1) / var.pow(2).clamp_min(1e-30)
    ratio = w.abs().amax(1) / w.abs().mean(1).clamp_min(1e-30)
    return kurtosis, ratio


def class_stats(model_dir: Path) -> dict[str, dict[str, float]]:
    """Linear class -> median and max over its channels of both statistics, and the same for Gaussian weights of the
    same shapes (seeded), plus the class's parameter count."""
    from optimum_qnn.models.gemma4.loading import load_text_model

    hf = load_text_model(model_dir)[0]
    gen = torch.Generator().manual_seed(0)
    gathered: dict[str, dict[str, list[torch.Tensor]]] = {}
    for name, module in hf.named_modules():
        match = _CLASS.search(name)
        if not isinstance(module, torch.nn.Linear) or match is None:
            continue
        entry = gathered.setdefault(match.group(1), {"k": [], "r": [], "gk": [], "gr": [], "n": []})
        k, r = channel_stats(module.weight)
        gk, gr = channel_stats(torch.randn(module.weight.shape, generator=gen, dtype=torch.float64))
        entry["k"].append(k)
        entry["r"].append(r)
        entry["gk"].append(gk)
        entry["gr"].append(gr)
        entry["n"].append(torch.tensor([module.weight.numel()]))
    out = {}
    for cls, entry in gathered.items():
        k, r, gk, gr = (torch.cat(entry[key]) for key in ("k", "r", "gk", "gr"))
        out[cls] = {
            "params": int(torch.cat(entry["n"]).sum()),
            "kurtosis median": k.median().item(), "kurtosis max": k.max().item(),
            "max/mean median": r.median().item(), "max/mean max": r.max().item(),
            "gaussian kurtosis max": gk.max().item(), "gaussian max/mean max": gr.max().item(),
        }
    return out


def table(stats: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: one line per model and linear class."""
    header = ["model", "linear class", "params", "kurtosis: median / max (Gaussian max)",
              "max/mean: median / max (Gaussian max)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model, classes in stats.items():
        for cls, s in classes.items():
            lines.append(
                f"| {model} | {cls} | {s['params']:,} | {s['kurtosis median']:.1f} / {s['kurtosis max']:.1f} "
                f"({s['gaussian kurtosis max']:.1f}) | {s['max/mean median']:.1f} / {s['max/mean max']:.1f} "
                f"({s['gaussian max/mean max']:.1f}) |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(table({m.name: class_stats(m) for m in args.models}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
