"""Benchmarks: export cost per stage and runtime speed of the demo Gemma4, per quant scheme.

Prints a table and writes benchmarks/RESULTS.md (with the machine and versions). Runtime figures are measured on the
x86 HTP emulator, so they say how the host side performs (time per step outside the .pte), not how fast a phone is.

Usage: python benchmarks/run.py [--schemes fp16 16a8w] [--steps 32]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

import tiny_gemma4  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=["fp16", "16a8w"])
    parser.add_argument("--steps", type=int, default=32, help="decode steps per run")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from optimum_qnn import StaticCausalLM
    from optimum_qnn.calibration import CalibrationSource
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.export import export
    from optimum_qnn.modeling import QNNModelForCausalLM
    from optimum_qnn.models.gemma4.loading import load_text_model

    work = Path(tempfile.mkdtemp(prefix="optimum-qnn-bench-"))
    model_dir = tiny_gemma4.build(Path.home() / ".cache" / "optimum-qnn" / "test-models" / "demo-gemma4")
    calib = work / "calib.txt"
    calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:64]))
    hf = load_text_model(model_dir)[0]
    static = StaticCausalLM.from_hf(hf, max_context_len=128)
    held_out = torch.tensor([2] + list(range(100, 190)))

    rows = []
    for scheme in args.schemes:
        config = ExportConfig(
            socs=(Soc.SM8650,), quant=QuantScheme.parse(scheme), mode=ExportMode.HYBRID,
            shapes=ShapeConfig(128, 16), embedding_quant=EmbeddingQuant(0, 0) if scheme == "fp16" else EmbeddingQuant(8, 0),
            weight_sharing=False,
        )
        result = export(model_dir, work / scheme, config, calibration=CalibrationSource(file=calib, limit=16))
        stages = {s.name.split()[0]: s for s in result.stages}
        model = QNNModelForCausalLM.from_pretrained(work / scheme, quant=config.quant_tag)
        prompt = torch.tensor([2] + list(range(40, 72)))
        stats = []
        for _ in range(args.runs):
            model.generate(prompt, max_new_tokens=args.steps, eos_token_id=[])
            stats.append(model.stats)
        model._session.reset()
        got = model._session.feed(held_out)
        ref = static.session().feed(held_out)
        sqnr = 10 * torch.log10(ref.pow(2).mean() / (got - ref).pow(2).mean()).item()
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        pte = result.variants[0] / "model.pte"
        rows.append({
            "scheme": scheme,
            "export s": sum(s.seconds for s in result.stages),
            "lower s": stages["lower"].seconds,
            "peak RSS MB": max(s.peak_rss_mb for s in result.stages),
            ".pte KB": pte.stat().st_size / 1024,
            "TTFT ms": statistics.median(s.time_to_first_token_s for s in stats) * 1000,
            "prefill tok/s": statistics.median(s.prefill_tokens_per_s for s in stats),
            "decode tok/s": statistics.median(s.decode_tokens_per_s for s in stats),
            "host overhead": statistics.median(s.host_overhead_share for s in stats),
            "SQNR dB": sqnr,
            "top-1": top1,
        })
        print("ROW", rows[-1], flush=True)

    header = list(rows[0])
    fmt = {"host overhead": "{:.1%}", "top-1": "{:.2f}"}
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["scheme"]] + [fmt.get(k, "{:.1f}").format(row[k]) for k in header[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("torch", "executorch", "onnxruntime-qnn", "transformers"))
    text = (
        "# Benchmarks\n\n"
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, Python {platform.python_version()}; {versions}.\n"
        f"Model: the demo Gemma4 (examples/tiny_gemma4.py), hybrid, context 128, prefill 16, SM8650, run on the x86 HTP "
        f"emulator; {args.steps} decode steps, median of {args.runs} runs. SQNR / top-1: logits of {held_out.numel()} "
        "tokens against the fp32 Hugging Face model.\n\n"
        "Host overhead = share of a decode step spent outside the .pte's execute call (Python KV and mask "
        "management). Emulator speed says nothing about a phone's speed.\n\n" + table + "\n"
    )
    (HERE / "RESULTS.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
