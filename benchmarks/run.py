"""Benchmarks: export cost per stage (demo model and Gemma-4-E2B widths), the nearest peer, and per quant scheme
the accuracy, artifact size and runtime speed of the demo Gemma4 on the x86 HTP emulator.

Every export runs in its own process, so its peak RSS is that export's. Prints the tables and writes
benchmarks/RESULTS.md with the machine and versions. Runtime figures say how the host side performs (time per step
outside the .pte), not how fast a phone is.

Usage: python benchmarks/run.py [--sections schemes e2b peer] [--schemes fp16 16a8w] [--depths 2 7] [--steps 32] [--runs 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import e2b_full  # noqa: E402
import e2b_width  # noqa: E402
import peer  # noqa: E402
import tiny_gemma4  # noqa: E402
import weight_stats  # noqa: E402

from recipe import (  # noqa: E402
    BENCH_SCHEMES, CACHE, CONTEXT, DEMO_DIR, DEPTHS, E2B_CONTEXT, E2B_LAYERS_PER_SHARD, E2B_PREFILL, E2B_SCHEME, EMBEDDING_BITS,
    EVAL_TOKENS, MODEL_DIRS, PREFILL, ROWS_FILE, SCHEMES, SECTIONS, held_out_prompts,
    held_out_text,
)
from stored import source_commit  # noqa: E402


def size_lower_bound_bytes(hf_model, scheme: str) -> float:
    """Parameters x bits: the HTP weights at the scheme's width (a recipe's: its scheme's), the CPU embedding tables
    at theirs."""
    embed = {id(p) for name, p in hf_model.named_parameters() if "embed_tokens" in name}
    n_embed = sum(p.numel() for p in hf_model.parameters() if id(p) in embed)
    n_rest = sum(p.numel() for p in hf_model.parameters() if id(p) not in embed)
    # lm_head is tied to the token table but is a separate HTP copy in the .pte.
    n_rest += hf_model.lm_head.weight.numel()
    embed_bits = EMBEDDING_BITS.get(scheme, 8) or 32
    quant = scheme_config(scheme).quant
    return (n_rest * quant.weight_bits + n_embed * embed_bits) / 8


def stage_costs(result) -> dict[str, list[float]]:
    """Stage name (SoC and evaluation folded in) -> [wall s, peak RSS MB]; "evaluate" runs inside "write"."""
    costs: dict[str, list[float]] = {}
    evaluate_s = sum(s.seconds for s in result.stages if s.name == "evaluate")
    for s in result.stages:
        if s.name == "evaluate":
            continue
        name = s.name.split()[0]
        seconds = s.seconds - (evaluate_s if name == "write" else 0.0)
        prev = costs.get(name, [0.0, 0.0])
        costs[name] = [prev[0] + seconds, max(prev[1], s.peak_rss_mb)]
    return costs


def greedy_run(qnn_tokens, hf_tokens, start: int) -> int:
    """How many new tokens equal Hugging Face's before the first difference."""
    same = (qnn_tokens[0, start:] == hf_tokens[0, start:]).long()
    return int(same.cumprod(0).sum())


def scheme_config(scheme: str, weight_sharing: bool = False):
    """The ExportConfig of a scheme's benchmark row (a recipe's fields for a recipe name): SM8650, hybrid, the
    benchmark's context, 8-bit tables with zero points; weights not shared (the emulator builds) unless asked."""
    from optimum_qnn.config import RECIPES, EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc, recipe_fields

    fields = recipe_fields(scheme) if scheme in RECIPES else {"quant": QuantScheme.parse(scheme)}
    return ExportConfig(
        **fields, socs=(Soc.SM8650,), mode=ExportMode.HYBRID, shapes=ShapeConfig(CONTEXT, PREFILL),
        # 8-bit tables, one group per row, with zero points (as the demo: examples/demo.py says why).
        embedding_quant=EmbeddingQuant(EMBEDDING_BITS.get(scheme, 8), 0, symmetric=False), weight_sharing=weight_sharing,
    )


def scheme_child(scheme: str, work: Path, steps: int, runs: int, model_name: str = "demo") -> dict:
    """Export one model at one scheme and measure it; runs in its own process."""
    import torch

    from optimum_qnn import StaticCausalLM
    from optimum_qnn.quantization.calibration import CalibrationSource
    from optimum_qnn.contract import DECODE_METHOD
    from optimum_qnn.exporter.evaluation import sqnr_db
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM
    from optimum_qnn.models.gemma4.loading import load_text_model

    from transformers import AutoTokenizer

    model_dir = MODEL_DIRS[model_name]
    config = scheme_config(scheme)
    commit = source_commit()
    out = work / model_name / scheme
    calibration = CalibrationSource(file=work / "calib.txt", limit=16)
    result = export(model_dir, out, config, calibration=calibration, evaluate=work / "held_out.txt", evaluate_tokens=EVAL_TOKENS)
    costs = stage_costs(result)
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
    model.backend.session.reset()
    got_decode = model.backend.session.feed_method(DECODE_METHOD, held_ids)
    greedy = []
    for ids in [prompt.tolist(), *held_out_prompts(AutoTokenizer.from_pretrained(model_dir))]:
        ids = torch.tensor(ids)
        hf_tokens = hf.generate(ids.unsqueeze(0), max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
        qnn_tokens = model.generate(ids, max_new_tokens=steps, eos_token_id=[])
        greedy.append(greedy_run(qnn_tokens, hf_tokens, ids.numel()))
    pte = result.variants[0] / "model.pte"
    bound = size_lower_bound_bytes(hf, scheme)
    return {
        "scheme": config.quant_tag,
        "model": model_name,
        "commit": commit,
        "export s": sum(c[0] for c in costs.values()),
        "peak RSS MB": max(c[1] for c in costs.values()),
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
        "greedy = HF": greedy[0],
        "greedy, held-out prompts": greedy[1:],
        "eval tokens": evaluation.tokens,
        "stages": costs,
    }


def e2b_child(depth: int, work: Path) -> dict:
    """Export the E2B-width checkpoint of `depth` layers (a phone build: hybrid, weights shared); own process."""
    from optimum_qnn.config import ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    folder = CACHE / "bench-models" / f"e2b-width-{depth}"
    config = ExportConfig(
        socs=(Soc.SM8650,), quant=QuantScheme.parse(E2B_SCHEME), mode=ExportMode.HYBRID,
        shapes=ShapeConfig(E2B_CONTEXT, E2B_PREFILL), weight_sharing=True, shards=depth // E2B_LAYERS_PER_SHARD,
    )
    result = export(folder, work / f"e2b-{depth}", config)
    pte = result.variants[0] / "model.pte"
    return {"depth": depth, "stages": stage_costs(result), "pte MB": pte.stat().st_size / 2**20}


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


def run_child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("ROW ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"benchmark process {' '.join(args)} failed (exit {proc.returncode})")
    print(line, flush=True)
    return json.loads(line[4:])


# Like for like with the peer's XNNPACK recipe: float weights, no calibration, one method taking a token per call.
OUR_PEER_RUN = (f"QNN fp16, decode only (`--quant fp16 --mode kv --embedding-quant none --max-seq-len {CONTEXT}`)",
                ["--quant", "fp16", "--mode", "kv", "--embedding-quant", "none", "--max-seq-len", str(CONTEXT)])


def machine_line() -> str:
    """This machine and the versions of the stack, as RESULTS.md's first line shows them (stored with the rows)."""
    import torch

    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("torch", "executorch", "onnxruntime-qnn", "transformers"))
    return (f"{platform.machine()}, {torch.get_num_threads()} threads, {e2b_full.mem_total_gb():.0f} GB RAM, "
            f"Python {platform.python_version()}; {versions}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="*", default=SCHEMES)
    parser.add_argument("--bench-schemes", nargs="*", default=BENCH_SCHEMES)
    parser.add_argument("--model", choices=list(MODEL_DIRS), default="demo", help=argparse.SUPPRESS)
    parser.add_argument("--depths", nargs="*", type=int, default=list(DEPTHS), choices=list(DEPTHS))
    parser.add_argument("--sections", nargs="*", choices=SECTIONS, default=SECTIONS,
                        help="measure only these; the others are read from benchmarks/rows.json (a previous run); "
                             "none: write RESULTS.md again from the stored rows (and benchmarks/e2b_full.json)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per run")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--e2b-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("ROW " + json.dumps(scheme_child(args.child, args.work, args.steps, args.runs, args.model)), flush=True)
        return 0
    if args.e2b_child is not None:
        print("ROW " + json.dumps(e2b_child(args.e2b_child, args.work)), flush=True)
        return 0

    import results as results_md  # noqa: E402  (it imports this module)

    stored = json.loads(ROWS_FILE.read_text()) if ROWS_FILE.is_file() else {}
    missing = [s for s in SECTIONS if s not in args.sections and s not in stored]
    if missing:
        raise SystemExit(f"No stored rows for {missing} in {ROWS_FILE}: measure them (--sections {' '.join(missing)})")
    results = {s: stored[s] for s in SECTIONS if s not in args.sections}
    minutes = {s: stored["minutes"][s] for s in results}
    work = Path(tempfile.mkdtemp(prefix="optimum-qnn-bench-"))
    t0 = time.perf_counter()
    tiny_gemma4.build(DEMO_DIR)
    (work / "calib.txt").write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:64]))
    (work / "held_out.txt").write_text(held_out_text())

    for section, model_name, schemes in (("schemes", "demo", args.schemes), ("bench", "bench", args.bench_schemes)):
        if section not in args.sections:
            continue
        if model_name != "demo":
            tiny_gemma4.build(MODEL_DIRS[model_name], size=model_name)
        measured = []
        for scheme in schemes:
            print(f"== {model_name} model, {scheme}", flush=True)
            child = ["--child", scheme, "--model", model_name, "--work", str(work), "--steps", str(args.steps),
                     "--runs", str(args.runs)]
            measured.append(run_child(child))
        results[section] = results_md.merge_rows(stored.get(section, []), measured)
        minutes[section], t0 = (time.perf_counter() - t0) / 60, time.perf_counter()
    if "bench" in args.sections:
        results["weights"] = {name: weight_stats.class_stats(folder) for name, folder in MODEL_DIRS.items()}
    elif "weights" in stored:
        results["weights"] = stored["weights"]
    if "e2b" in args.sections:
        results["e2b"] = []
        for depth in args.depths:
            print(f"== E2B widths, {depth} layers", flush=True)
            e2b_width.build(CACHE / "bench-models" / f"e2b-width-{depth}", depth, DEPTHS[depth])
            results["e2b"].append(run_child(["--e2b-child", str(depth), "--work", str(work)]))
        minutes["e2b"], t0 = (time.perf_counter() - t0) / 60, time.perf_counter()
    if "peer" in args.sections:
        print("== optimum-executorch side by side", flush=True)
        model_dir = peer.build_shared_model(CACHE / "bench-models" / "demo-shared-heads", DEMO_DIR)
        theirs = peer.peer_export(model_dir, work / "peer", work / "peer.log", max_seq_len=CONTEXT)
        if theirs.returncode:
            raise SystemExit(f"optimum-executorch export failed (exit {theirs.returncode}); see {theirs.log}")
        what, extra = OUR_PEER_RUN
        ours = peer.our_export(model_dir, work / "ours", work / "ours.log", *extra)
        if ours.returncode:
            raise SystemExit(f"optimum-qnn export failed (exit {ours.returncode}); see {ours.log}")
        results["peer"] = {"theirs": dataclasses.asdict(theirs), "ours": {what: dataclasses.asdict(ours)}}
        minutes["peer"] = (time.perf_counter() - t0) / 60
    if set(args.sections) & {"schemes", "bench"}:
        results["machine"] = machine_line()
        results["settings"] = {"steps": args.steps, "runs": args.runs}
    else:
        results["machine"], results["settings"] = stored.get("machine"), stored.get("settings")
    ROWS_FILE.write_text(json.dumps({**results, "minutes": minutes}, indent=1) + "\n")

    text = results_md.write()
    print(text)
    return 0



if __name__ == "__main__":
    sys.exit(main())
