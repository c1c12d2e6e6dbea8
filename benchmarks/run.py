"""Benchmarks: export cost, artifact size, accuracy and runtime speed of the demo Gemma4, per quant scheme.

Each scheme is exported in its own process (so peak RSS is that export's), then its .pte runs on the x86 HTP
emulator. Prints a table and writes benchmarks/RESULTS.md with the machine and versions. Runtime figures say how the
host side performs (time per step outside the .pte), not how fast a phone is.

Usage: python benchmarks/run.py [--schemes fp16 16a8w] [--steps 32] [--runs 3]
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

import tiny_gemma4  # noqa: E402

SCHEMES = ["fp16", "16a16w", "16a8w", "16a4w", "16a4w_block", "8a8w"]
CONTEXT, PREFILL = 128, 16
EMBEDDING_BITS = {"fp16": 0}  # CPU-side tables: float for fp16, 8-bit per row otherwise
# Held-out text for perplexity: docstrings of standard-library modules. The demo model trains on CPython's
# `pydoc_data.topics` (the language reference), which does not contain them.
HELD_OUT_MODULES = ["argparse", "collections", "csv", "functools", "itertools", "json", "logging", "pathlib", "subprocess", "textwrap"]


def held_out_text() -> str:
    import importlib

    return "\n\n".join(inspect.getdoc(importlib.import_module(name)) or "" for name in HELD_OUT_MODULES)


def size_lower_bound_bytes(hf_model, scheme: str) -> float:
    """Parameters x bits: the HTP weights at the scheme's width, the CPU embedding tables at theirs."""
    from optimum_qnn.config import QuantScheme

    embed = {id(p) for name, p in hf_model.named_parameters() if "embed_tokens" in name}
    n_embed = sum(p.numel() for p in hf_model.parameters() if id(p) in embed)
    n_rest = sum(p.numel() for p in hf_model.parameters() if id(p) not in embed)
    # lm_head is tied to the token table but is a separate HTP copy in the .pte.
    n_rest += hf_model.lm_head.weight.numel()
    embed_bits = EMBEDDING_BITS.get(scheme, 8) or 32
    return (n_rest * QuantScheme.parse(scheme).weight_bits + n_embed * embed_bits) / 8


def child(scheme: str, work: Path, steps: int, runs: int) -> dict:
    """Export one scheme and measure it; runs in its own process."""
    from optimum_qnn import StaticCausalLM
    from optimum_qnn.calibration import CalibrationSource
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.contract import DECODE_METHOD
    from optimum_qnn.evaluation import sqnr_db
    from optimum_qnn.export import export
    from optimum_qnn.modeling import QNNModelForCausalLM
    from optimum_qnn.models.gemma4.loading import load_text_model

    model_dir = tiny_gemma4.build(Path.home() / ".cache" / "optimum-qnn" / "test-models" / "demo-gemma4")
    calib = work / "calib.txt"
    held_out = work / "held_out.txt"
    config = ExportConfig(
        socs=(Soc.SM8650,), quant=QuantScheme.parse(scheme), mode=ExportMode.HYBRID, shapes=ShapeConfig(CONTEXT, PREFILL),
        embedding_quant=EmbeddingQuant(EMBEDDING_BITS.get(scheme, 8), 0), weight_sharing=False,
    )
    out = work / scheme
    result = export(model_dir, out, config, calibration=CalibrationSource(file=calib, limit=16), evaluate=held_out)
    # --evaluate runs inside the write stage: its time is not export time, and the peak RSS of the export is the
    # process's peak when lowering ends (ru_maxrss only grows).
    evaluate_s = sum(s.seconds for s in result.stages if s.name == "evaluate")
    export_stages = [s for s in result.stages if s.name != "evaluate"]
    hf = load_text_model(model_dir)[0]
    static = StaticCausalLM.from_hf(hf, max_context_len=CONTEXT)
    model = QNNModelForCausalLM.from_pretrained(out, quant=config.quant_tag)
    evaluation = model.manifest.evaluation

    prompt = torch.tensor([2] + list(range(40, 72)))
    stats = []
    for _ in range(runs):
        model.generate(prompt, max_new_tokens=steps, eos_token_id=[])
        stats.append(model.stats)
    held_ids = torch.tensor([2] + list(range(100, 190)))
    ref = static.session().feed(held_ids)
    model._session.reset()
    got_decode = model._session.feed_method(DECODE_METHOD, held_ids)
    hf_tokens = hf.generate(prompt.unsqueeze(0), max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    qnn_tokens = model.generate(prompt, max_new_tokens=steps, eos_token_id=[])
    same = (qnn_tokens[0, prompt.numel():] == hf_tokens[0, prompt.numel():]).long()
    pte = result.variants[0] / "model.pte"
    bound = size_lower_bound_bytes(hf, scheme)
    return {
        "scheme": config.quant_tag,
        "export s": sum(s.seconds for s in export_stages) - evaluate_s,
        "lower s": next(s.seconds for s in export_stages if s.name.startswith("lower")),
        "peak RSS MB": next(s.peak_rss_mb for s in export_stages if s.name.startswith("lower")),
        ".pte KB": pte.stat().st_size / 1024,
        "size / bound": pte.stat().st_size / bound,
        "TTFT ms": statistics.median(s.time_to_first_token_s for s in stats) * 1000,
        "prefill tok/s": statistics.median(s.prefill_tokens_per_s for s in stats),
        "decode tok/s": statistics.median(s.decode_tokens_per_s for s in stats),
        "host overhead": statistics.median(s.host_overhead_share for s in stats),
        "PPL fp32": evaluation.perplexity_reference,
        "PPL .pte": evaluation.perplexity_exported,
        "SQNR dB": evaluation.sqnr_db,
        "decode SQNR dB": sqnr_db(got_decode, ref),
        "top-1": evaluation.top1_agreement,
        "greedy = HF": int(same.cumprod(0).sum()),
        "eval tokens": evaluation.tokens,
    }


FORMATS = {"host overhead": "{:.1%}", "top-1": "{:.3f}", "size / bound": "{:.2f}x", "PPL fp32": "{:.2f}", "PPL .pte": "{:.2f}",
           "eval tokens": "{:d}"}


def table(rows: list[dict], steps: int) -> str:
    header = [k for k in rows[0] if k != "eval tokens"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["scheme"]]
        for key in header[1:]:
            fmt = "{:d}/" + str(steps) if key == "greedy = HF" else FORMATS.get(key, "{:.1f}")
            cells.append(fmt.format(row[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=SCHEMES)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("ROW " + json.dumps(child(args.child, args.work, args.steps, args.runs)), flush=True)
        return 0

    work = Path(tempfile.mkdtemp(prefix="optimum-qnn-bench-"))
    tiny_gemma4.build(Path.home() / ".cache" / "optimum-qnn" / "test-models" / "demo-gemma4")
    (work / "calib.txt").write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:64]))
    (work / "held_out.txt").write_text(held_out_text())
    rows = []
    for scheme in args.schemes:
        print(f"== {scheme}", flush=True)
        proc = subprocess.run(
            [sys.executable, __file__, "--child", scheme, "--work", str(work), "--steps", str(args.steps), "--runs", str(args.runs)],
            stdout=subprocess.PIPE, text=True,
        )
        line = next((l for l in proc.stdout.splitlines() if l.startswith("ROW ")), None)
        if proc.returncode != 0 or line is None:
            print(f"{scheme}: the benchmark process failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        rows.append(json.loads(line[4:]))
        print(line, flush=True)

    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("torch", "executorch", "onnxruntime-qnn", "transformers"))
    text = (
        "# Benchmarks\n\n"
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, Python {platform.python_version()}; {versions}.\n\n"
        f"Model: the demo Gemma4 (examples/tiny_gemma4.py: every trait on, trained on CPython's `pydoc_data.topics`), "
        f"hybrid, context {CONTEXT}, prefill {PREFILL}, SM8650, run on the x86 HTP emulator. Each export runs in its own "
        "process; export s and peak RSS cover load to write. CPU embedding tables: float for fp16, 8-bit per row "
        "otherwise.\n\n"
        "- size / bound: the .pte against parameters x bits (HTP weights at the scheme's width including the lm_head "
        "copy, embedding tables at theirs). These emulator builds have weight sharing off, so the prefill and decode "
        "graphs each hold the HTP weights: about 2x is expected; a phone build (weight sharing on) stores them once.\n"
        f"- PPL: perplexity on {rows[0]['eval tokens']} held-out tokens (docstrings of the standard-library modules "
        f"{', '.join(HELD_OUT_MODULES)}), fp32 Hugging Face vs the .pte, in windows of the context "
        "(`optimum-cli export qnn --evaluate`); SQNR and top-1 are the logits over the same tokens.\n"
        "- decode SQNR: 91 tokens fed one by one through the decode method only, against fp32.\n"
        f"- greedy = HF: of {args.steps} new tokens, how many equal Hugging Face `generate` before the first difference.\n"
        f"- TTFT, tok/s and host overhead (the share of a decode step spent outside the .pte's execute call): a 33-token "
        f"prompt, {args.steps} decode steps, median of {args.runs} runs. Emulator speed says nothing about a phone's speed.\n\n"
        + table(rows, args.steps) + "\n"
    )
    (HERE / "RESULTS.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
