"""Can a few backward passes replace one model pass per linear in the sensitivity plan? Measured against the exact plan.

The `--size-budget` plan measures each linear's effect on the logits by running the model once with only that
linear rounded to 4 bits: one pass per linear, 277 whole-model passes at Gemma-4-E2B's size (QUANT_NOTES.md section
9). To first order the logits' change from linear i is ``J_i dW_i x``, and for a random vector ``v`` over the logits,
``E[(v . J_i dW_i x)^2] = |J_i dW_i x|^2``. One backward pass of ``v . logits`` gives ``v . J_i dW_i x`` for every
linear at once (the gradient at the linear's output dotted with ``dW_i x``), so K probes estimate every linear's noise
with one forward and K backward passes, independent of the number of linears. The exporter's plan is this estimate
(`mixed_precision.probe_sensitivity`); the script measures it against the exact one.

This compares the two on a checkpoint (HF eager forward in fp32, 4 windows of 128 calibration tokens, every linear
rounded as the quantizer rounds 4-bit block-64 weights): the rank correlation of noise per parameter, the linears
each keeps at 8 bits within a 25% budget, and the held-out logits SQNR of the resulting mixed weights. Prints a table
and stores its rows in benchmarks/sensitivity_probe.json, keyed by model folder name and method, with the commit they
ran on (rows of other models are kept).

Usage: python benchmarks/sensitivity_probe.py MODEL_DIR [MODEL_DIR ...] [--probes 8 16 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from optimum_qnn.metrics import db_of_noise, noise_of_db, sqnr_db

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

BLOCK, CONTEXT, WINDOWS, SHARE = 64, 128, 4, 0.25
ROWS_FILE = HERE / "sensitivity_probe.json"


def windows_of(tokenizer, text: str, count: int) -> list[torch.Tensor]:
    """`count` windows of CONTEXT tokens, BOS first, as `--evaluate` cuts them."""
    from optimum_qnn.exporter.evaluation import windows

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return windows(ids, CONTEXT, tokenizer.bos_token_id, max_tokens=count * (CONTEXT - 1))


def linears_of(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def logits_of(model: nn.Module, windows: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([model(input_ids=w.unsqueeze(0)).logits[0] for w in windows])


def noise_of(sqnr: dict[str, float]) -> dict[str, float]:
    """Logits SQNR in dB -> noise power over the logits' power (0 where rounding changed nothing)."""
    return {name: noise_of_db(db) for name, db in sqnr.items()}


def exact_noise(model: nn.Module, windows: list[torch.Tensor]) -> dict[str, float]:
    """Each linear alone at 4 bits: the logits' noise power over their power, measured as the exporter's plan does
    (`mixed_precision.measure_sensitivity`)."""
    from optimum_qnn.quantization.mixed_precision import measure_sensitivity
    from optimum_qnn.quantization.weight_search import block_of

    sqnr = measure_sensitivity(linears_of(model), lambda: logits_of(model, windows), lambda m: block_of(m, BLOCK))
    return noise_of(sqnr)


def probe_noise(model: nn.Module, windows: list[torch.Tensor], probes: int, seed: int = 0) -> dict[str, float]:
    """The same, estimated to first order from `probes` random-probe backward passes, as the exporter's plan does
    (`mixed_precision.probe_sensitivity`)."""
    from optimum_qnn.quantization.mixed_precision import probe_sensitivity
    from optimum_qnn.quantization.weight_search import block_of

    sqnr = probe_sensitivity(model, linears_of(model), lambda: logits_of(model, windows), lambda m: block_of(m, BLOCK),
                             probes=probes, seed=seed)
    return noise_of(sqnr)


def spearman(a: list[float], b: list[float]) -> float:
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def mixed_sqnr(model_dir: Path, kept: set[str], windows: list[torch.Tensor]) -> float:
    """Held-out logits SQNR with every linear at 4 bits except `kept` at 8 (weight-only, rounded as the quantizer)."""
    from optimum_qnn.models.gemma4.loading import load_text_model
    from optimum_qnn.quantization.weight_search import block_of, fake_quantize_weight

    model = load_text_model(model_dir)[0].float().eval()
    with torch.no_grad():
        ref = logits_of(model, windows).double()
        for name, m in linears_of(model).items():
            m.weight.copy_(fake_quantize_weight(m.weight, 8, None) if name in kept else fake_quantize_weight(m.weight, 4, block_of(m, BLOCK)))
        got = logits_of(model, windows).double()
    return sqnr_db(got, ref)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--probes", nargs="*", type=int, default=[8, 16, 32])
    args = parser.parse_args()

    from transformers import AutoTokenizer

    import recipe
    from stored import source_commit
    import tiny_gemma4
    from optimum_qnn.config import SizeBudget
    from optimum_qnn.quantization.mixed_precision import plan
    from optimum_qnn.models.gemma4.loading import load_text_model

    print("| model | method | passes (forward + backward) | s | Spearman of noise/param vs exact | kept at 8 bits: "
          "linears (same as exact) | held-out SQNR dB with that plan |\n|---|---|---|---|---|---|---|")
    stored = json.loads(ROWS_FILE.read_text()) if ROWS_FILE.is_file() else {}
    commit = source_commit()
    for model_dir in args.models:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        calibration = windows_of(tokenizer, tiny_gemma4.corpus(), WINDOWS)
        held_out = windows_of(tokenizer, recipe.held_out_text(), 8)
        model = load_text_model(model_dir)[0].float().eval()
        params = {n: m.weight.numel() for n, m in linears_of(model).items()}
        budget = SizeBudget(share=SHARE)

        def kept_by(noise: dict[str, float]) -> set[str]:
            sqnr = {n: min(db_of_noise(v), 200.0) for n, v in noise.items()}
            return set(plan(sqnr, params, budget).kept)

        rows = stored[model_dir.name] = {}

        def row(method: str, passes: str, seconds: float, noise: dict[str, float]) -> None:
            kept = kept_by(noise)
            rho = spearman([noise[n] / params[n] for n in params], [exact[n] / params[n] for n in params])
            held_out_sqnr = mixed_sqnr(model_dir, kept, held_out)
            print(f"| {model_dir.name} | {method} | {passes} | {seconds:.0f} | {rho:.3f} | {len(kept)} "
                  f"({len(kept & exact_kept)}) | {held_out_sqnr:.2f} |", flush=True)
            rows[method] = {"passes": passes, "s": seconds, "Spearman vs exact": rho, "kept": len(kept),
                            "kept as exact": len(kept & exact_kept), "held-out SQNR dB": held_out_sqnr, "commit": commit}

        t0 = time.perf_counter()
        exact = exact_noise(model, calibration)
        exact_kept = kept_by(exact)
        row("exact, one pass per linear", f"{len(params)} + 0", time.perf_counter() - t0, exact)
        for probes in args.probes:
            t0 = time.perf_counter()
            estimate = probe_noise(model, calibration, probes)
            row(f"{probes} random probes", f"1 + {probes}", time.perf_counter() - t0, estimate)
    ROWS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
