"""Time to first token of a conversation's turns with cache reuse against a full re-prefill, on the HTP emulator.

The demo Gemma4 (its chat template, SM8650, hybrid, 16a8w calibrated) exported with a 512-token context and 32-token
prefill chunks; one 5-turn conversation through `model.chat()` (each turn prefills only its own tokens), then each
turn's whole prompt again through `generate` from an empty cache. Both in one run, one after the other, so the ratio
compares like with like. Rows go to benchmarks/chat_reuse.json with the commit they ran on; prints a table.

Usage: ``python benchmarks/chat_reuse.py [--repeats 3] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

CONTEXT, CHUNK, REPLY = 512, 32, 16
# Five user turns of a typical chat's length (20-40 tokens each with the template's markers).
TURNS = [
    "How does the for statement work on a list of numbers?",
    "And what does the while statement do when its condition is false?",
    "What happens when an exception is raised inside a try block?",
    "How do I define a class with a method that returns a value?",
    "What is the difference between a list and a tuple?",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="conversations timed (the median is stored)")
    parser.add_argument("--out", type=Path, default=None, help="where the export goes (default: a temporary folder)")
    args = parser.parse_args()

    from optimum_qnn.console import configure_logging, third_party_quiet

    configure_logging(False)
    with third_party_quiet(False, keep_stdout=True):
        import tiny_gemma4

        from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
        from optimum_qnn.exporter.pipeline import export
        from optimum_qnn.quantization.calibration import CalibrationSource
        from optimum_qnn.runtime.modeling import QNNModelForCausalLM

        import recipe  # the benchmarks' model cache: the demo where the tests keep it

        model_dir = tiny_gemma4.build(recipe.DEMO_DIR)
        out = args.out or Path(tempfile.mkdtemp(prefix="optimum-qnn-chat-bench-"))
        if not (out / "qnn_index.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            calib = out.parent / f"{out.name}-calibration.txt"
            calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:40]))
            config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.A16W8, mode=ExportMode.HYBRID,
                                  shapes=ShapeConfig(CONTEXT, CHUNK), embedding_quant=EmbeddingQuant(8, 0),
                                  weight_sharing=False)
            print(f"exporting the demo model: SM8650, hybrid, 16a8w, context {CONTEXT}, prefill {CHUNK}", flush=True)
            export(model_dir, out, config, calibration=CalibrationSource(file=calib, limit=8))
        model = QNNModelForCausalLM.from_pretrained(out)

    runs = []
    for r in range(args.repeats):
        model.clear_cache()  # the previous conversation's prompts would otherwise be reused by this one's first turn
        chat = model.chat(max_new_tokens=REPLY)
        turns = []
        for text in TURNS:
            chat.send(text)
            s = chat.stats
            turns.append({"prompt": chat.input_ids[: s.prompt_tokens], "reused": s.reused_tokens,
                          "prefilled": s.prefilled_tokens, "ttft_reuse_s": s.time_to_first_token_s})
        for t in turns:  # the same prompts from an empty cache
            model.generate(t["prompt"], max_new_tokens=1, reuse_cache=False)
            t["ttft_full_s"] = model.stats.time_to_first_token_s
        runs.append(turns)
        print(f"conversation {r + 1}/{args.repeats} timed", flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    rows = []
    for k in range(len(TURNS)):
        reuse = statistics.median(run[k]["ttft_reuse_s"] for run in runs)
        full = statistics.median(run[k]["ttft_full_s"] for run in runs)
        t = runs[0][k]
        rows.append({"turn": k + 1, "prompt_tokens": len(t["prompt"]), "reused_tokens": t["reused"],
                     "prefilled_tokens": t["prefilled"], "ttft_reuse_s": round(reuse, 4), "ttft_full_s": round(full, 4),
                     "ratio": round(reuse / full, 3)})
    result = {"commit": commit, "date": time.strftime("%Y-%m-%d"), "model": "demo (examples/tiny_gemma4.py)",
              "export": f"SM8650 hybrid 16a8w, context {CONTEXT}, prefill {CHUNK}, x86 HTP emulator",
              "reply_tokens": REPLY, "repeats": args.repeats, "turns": rows}
    (HERE / "chat_reuse.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n| turn | prompt tokens | reused | prefilled | first token, reuse (s) | first token, full prefill (s) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['turn']} | {row['prompt_tokens']} | {row['reused_tokens']} | {row['prefilled_tokens']} | "
              f"{row['ttft_reuse_s']:.3f} | {row['ttft_full_s']:.3f} | {row['ratio']:.2f} |")
    import results

    results.write()
    print(f"\nstored in {HERE / 'chat_reuse.json'} (commit {commit}); benchmarks/RESULTS.md rendered again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
