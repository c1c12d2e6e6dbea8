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
import inspect
import json
import os
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
import io_bytes  # noqa: E402
import peer  # noqa: E402
import tiny_gemma4  # noqa: E402
import weight_stats  # noqa: E402

# 16a4w_e2b is a recipe (optimum_qnn.config.RECIPES): 16a4w_block plus output-MSE ranges and a 25% 8-bit plan.
SCHEMES = ["fp16", "16a16w", "16a8w", "16a4w", "16a4w_block", "16a4w_e2b", "8a8w"]
CONTEXT, PREFILL = 128, 16
EVAL_TOKENS = 1024
EMBEDDING_BITS = {"fp16": 0}  # CPU-side tables: float for fp16, 8-bit per row otherwise
# Gemma-4-E2B widths at reduced depth: (layers, of which KV-reusing). Depth 7 has sliding and full layers of both kinds.
DEPTHS = {2: 0, 7: 2}
E2B_SCHEME, E2B_CONTEXT, E2B_PREFILL = "16a4w", 1024, 128
# One shard per decoder layer (`--shards depth`): each HTP context is compiled on its own, so the compiler's peak
# is one layer's, at every depth, and the line through the depths stays a line.
E2B_LAYERS_PER_SHARD = 1
# The larger benchmark model (examples/tiny_gemma4.py --size bench) at the schemes a phone build chooses between.
BENCH_SCHEMES = ["16a8w", "16a4w_block", "16a4w_e2b"]
SECTIONS = ["schemes", "bench", "e2b", "peer"]
ROWS_FILE = HERE / "rows.json"
STAGES = ["load", "swap", "export", "calibrate", "quantize", "lower", "write"]
# The models are cached where the package caches (`$OPTIMUM_QNN_CACHE`), the demo model where the tests keep it
# (`$OPTIMUM_QNN_TEST_CACHE`), so a checkout whose examples/tiny_gemma4.py differs never rebuilds another's models.
CACHE = Path(os.environ.get("OPTIMUM_QNN_CACHE", Path.home() / ".cache" / "optimum-qnn")).expanduser()
DEMO_DIR = Path(os.environ.get("OPTIMUM_QNN_TEST_CACHE", CACHE / "test-models")).expanduser() / "demo-gemma4"
MODEL_DIRS = {"demo": DEMO_DIR, "bench": CACHE / "bench-models" / "bench-gemma4"}
GREEDY_PROMPTS, GREEDY_PROMPT_TOKENS = 8, 24
# Held-out text for perplexity: docstrings of standard-library modules. The demo model trains on CPython's
# `pydoc_data.topics` (the language reference), which does not contain them.
HELD_OUT_MODULES = ["argparse", "collections", "csv", "functools", "itertools", "json", "logging", "pathlib", "subprocess", "textwrap"]


def held_out_text() -> str:
    import importlib

    return "\n\n".join(inspect.getdoc(importlib.import_module(name)) or "" for name in HELD_OUT_MODULES)


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


def held_out_prompts(tokenizer, count: int = GREEDY_PROMPTS, length: int = GREEDY_PROMPT_TOKENS) -> list[list[int]]:
    """`count` prompts of `length` tokens (BOS first), each the start of a different held-out module's docstring."""
    import importlib

    prompts = []
    for name in HELD_OUT_MODULES[:count]:
        ids = tokenizer(inspect.getdoc(importlib.import_module(name)) or "", add_special_tokens=False)["input_ids"]
        prompts.append([tokenizer.bos_token_id] + ids[: length - 1])
    return prompts


def source_commit() -> str:
    """The commit a measurement runs on, `-dirty` when the code it runs (package, benchmarks, examples) has uncommitted
    changes: every stored row records it, so a figure can be traced to the code that produced it."""
    root = HERE.parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "optimum_qnn", "benchmarks/*.py", "examples"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    return (commit or "unknown") + ("-dirty" if dirty else "")


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
# Tables
# ---------------------------------------------------------------------------------------------------------------

FORMATS = {"host overhead": "{:.1%}", "top-1": "{:.3f}", "size / bound": "{:.2f}x", "PPL fp32": "{:.2f}", "PPL .pte": "{:.2f}"}


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def scheme_table(rows: list[dict], steps: int) -> str:
    """One line per row; a column a row does not have (measured before the column existed) shows `-`."""
    header = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in ("eval tokens", "stages", "model", "commit")]
    cells = []
    for row in rows:
        line = [row["scheme"]]
        for key in header[1:]:
            value = row.get(key)
            if value is None:
                line.append("-")
            elif key == "greedy, held-out prompts":
                line.append(f"median {statistics.median(value):.0f}: " + " ".join(str(v) for v in value))
            else:
                fmt = "{:d}/" + str(steps) if key == "greedy = HF" else FORMATS.get(key, "{:.1f}")
                line.append(fmt.format(value))
        cells.append(line)
    return markdown(header, cells)


def bench_section(rows: list[dict] | None, weights: dict | None, steps: int) -> str:
    """The larger benchmark model's rows, and how heavy-tailed both models' weights are."""
    text = ""
    if rows:
        text += (
            "\n## The larger benchmark model: 16a8w, 16a4w_block and the 16a4w_e2b recipe\n\n"
            "Model: examples/tiny_gemma4.py --size bench (23 M parameters, 17 M in HTP linears; every Gemma4 trait "
            "on; 8 layers, hidden 384, head_dim 64/128, vocabulary 2048; trained here for 480 steps, about 16 min), "
            "measured exactly as the demo model above (same calibration, held-out text, prompts and emulator).\n\n"
            + scheme_table(rows, steps) + "\n"
        )
    if weights:
        text += (
            "\n## How heavy-tailed the weights are\n\n"
            "benchmarks/weight_stats.py, per output channel of each HTP linear: Pearson kurtosis (Gaussian: 3) and "
            "max |w| / mean |w|; median and maximum over the class's channels, and in brackets the maximum for "
            "Gaussian weights of the same shapes (what chance alone gives). Published figures for real LLMs are in "
            "benchmarks/QUANT_NOTES.md.\n\n" + weight_stats.table(weights) + "\n"
        )
    return text


def merge_rows(stored: list[dict], measured: list[dict]) -> list[dict]:
    """The stored rows with the freshly measured ones in place of those of the same scheme (new ones appended)."""
    fresh = {r["scheme"]: r for r in measured}
    merged = [fresh.pop(r["scheme"], r) for r in stored]
    return merged + list(fresh.values())


def fit_layers(points: list[tuple[float, float]], target: float) -> tuple[float, float]:
    """Least-squares line through (layer parameters, y); returns (slope per parameter, value at `target`)."""
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return slope, my + slope * (target - mx)


def cost_tables(demo: dict | None, e2b: list[dict]) -> tuple[str, list[str]]:
    """The per-stage table (wall s / peak RSS GB), with per-layer costs and the 35-layer extrapolation."""
    header = ["model", *[f"{s} s / GB" for s in STAGES], "total s", "peak GB"]

    def line(name: str, stages: dict[str, list[float]], total_s: float | None = None, peak: float | None = None) -> list[str]:
        cells = [name]
        for s in STAGES:
            sec, mb = stages.get(s, [0.0, 0.0])
            cells.append(f"{sec:.0f} / {mb / 1024:.1f}")
        total_s = sum(c[0] for c in stages.values()) if total_s is None else total_s
        peak = max(c[1] for c in stages.values()) / 1024 if peak is None else peak
        cells += [f"{total_s:.0f}", f"{peak:.1f}"]
        return cells

    rows, notes = [], []
    if demo is not None:
        rows.append(line(f"demo Gemma4 ({demo['scheme']}, hybrid, ctx {CONTEXT})", demo["stages"]))
    full_layers = e2b_width.depth_parameters(e2b_width.e2b_config())
    per_layer_params = full_layers / e2b_width.E2B_LAYERS
    xs = {}
    for r in e2b:
        xs[r["depth"]] = e2b_width.depth_parameters(e2b_width.e2b_config(r["depth"], DEPTHS[r["depth"]]))
        rows.append(line(f"E2B widths, {r['depth']} layers ({DEPTHS[r['depth']]} reuse KV)", r["stages"]))
    if len(e2b) >= 2:
        slope_row, extra_row = {}, {}
        for s in STAGES:
            slope_t, at_t = fit_layers([(xs[r["depth"]], r["stages"][s][0]) for r in e2b], full_layers)
            slope_m, at_m = fit_layers([(xs[r["depth"]], r["stages"][s][1]) for r in e2b], full_layers)
            slope_row[s] = [slope_t * per_layer_params, slope_m * per_layer_params]
            extra_row[s] = [at_t, at_m]
        rows.append(line("per E2B layer (fit, see below)", slope_row, peak=max(v[1] for v in slope_row.values()) / 1024))
        rows.append(line("**extrapolated: E2B, 35 layers**", extra_row))
        total = sum(v[0] for v in extra_row.values())
        peak = max(v[1] for v in extra_row.values()) / 1024
        notes.append(
            f"Extrapolated full Gemma-4-E2B export ({E2B_SCHEME}, hybrid, weights shared, "
            f"{e2b_width.E2B_LAYERS // E2B_LAYERS_PER_SHARD} shards): about {total / 60:.0f} min and "
            f"{peak:.1f} GB peak RSS. This is an extrapolation, not a measurement. The rows of this table were "
            "measured on an earlier pipeline (before the bf16 weights kept in the checkpoint's pages, the parallel shard "
            "compiles and the streamed program); the full-size measurements below supersede the extrapolation."
        )
    return markdown(header, rows), notes


def peer_table(ours: dict[str, peer.ProcessCost], theirs: peer.ProcessCost) -> str:
    header = ["exporter", "what it builds", "wall s", "peak RSS MB", "wall / peer", "RSS / peer"]
    rows = [[f"optimum-executorch 1.1.0 `--recipe xnnpack --max_seq_len {CONTEXT}`", "XNNPACK fp32, one token per call",
             f"{theirs.wall_s:.0f}", f"{theirs.peak_rss_mb:.0f}", "1.00x", "1.00x"]]
    for what, cost in ours.items():
        rows.append(["optimum-qnn `export qnn`", what, f"{cost.wall_s:.0f}", f"{cost.peak_rss_mb:.0f}",
                     f"{cost.wall_s / theirs.wall_s:.2f}x", f"{cost.peak_rss_mb / theirs.peak_rss_mb:.2f}x"])
    return markdown(header, rows)


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


IO_SECTION = (
    "\n## Graph IO per call at Gemma-4-E2B widths\n\n"
    "What crosses the graph boundary per call (benchmarks/io_bytes.py; sizes from the runner contract of E2B's "
    "published text config, prefill 128, so exact rather than sampled): quantized exports pass the masks, KV caches "
    "and logits as uint16 (the default), `--float-io` as float32.\n\n"
)


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
        results[section] = merge_rows(stored.get(section, []), measured)
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
    ROWS_FILE.write_text(json.dumps({**results, "minutes": minutes}, indent=1) + "\n")

    rows, e2b = results["schemes"], results["e2b"]
    theirs = peer.ProcessCost(**results["peer"]["theirs"])
    peer_text = peer_table({k: peer.ProcessCost(**v) for k, v in results["peer"]["ours"].items()}, theirs)
    demo_cost = next((r for r in rows if r["scheme"] == "16a8w"), rows[0] if rows else None)
    cost_text, notes = cost_tables(demo_cost, e2b)
    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("torch", "executorch", "onnxruntime-qnn", "transformers"))
    import torch

    text = (
        "# Benchmarks\n\n"
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, "
        f"{e2b_full.mem_total_gb():.0f} GB RAM, Python {platform.python_version()}; {versions}. "
        "Minutes per section (`make bench` runs all; `--sections` re-measures some and keeps the others' rows from "
        f"benchmarks/rows.json): {', '.join(f'{k} {v:.1f}' for k, v in minutes.items())}.\n\n"
        "## Export cost per stage\n\n"
        "Wall seconds and the highest RSS of the export process while the stage ran (sampled every 50 ms), from load "
        "to write; each export runs in its own process.\n\n"
        f"- demo Gemma4: examples/tiny_gemma4.py (every trait on, {rows and 'trained here'}), SM8650.\n"
        f"- E2B widths: benchmarks/e2b_width.py, Gemma-4-E2B's real widths (hidden 1536, 8 heads, 1 KV head, "
        "head_dim 256/512, MLP 6144/12288, vocab 262144, per-layer embeddings 256 per layer) with random bf16 "
        f"weights at reduced depth; {E2B_SCHEME}, hybrid (prefill {E2B_PREFILL} + decode), context {E2B_CONTEXT}, "
        "weights shared between the two graphs (the phone build), 4-bit embedding tables, SM8650, calibration on "
        f"random ids (no tokenizer), `--shards` = layers / {E2B_LAYERS_PER_SHARD} (one HTP context per "
        f"{E2B_LAYERS_PER_SHARD} layer(s), compiled one at a time).\n"
        "- per E2B layer: the slope of a line through the measured depths against the parameters that grow with "
        "depth (decoder layers, and the per-layer embedding table, 256 columns per layer), times those of an "
        "average E2B layer (120 M: 53 M in the layer, KV-reusing layers having a double-wide MLP, and 67 M of "
        "table). The extrapolated row is that line at E2B's 35 layers (4.21 B such parameters); the token table "
        "and lm_head are in the intercept. Peak RSS is fitted per stage and the maximum taken. It is an "
        "extrapolation from two depths, not a measurement.\n\n"
        + cost_text + "\n\n" + "".join(f"{n}\n\n" for n in notes)
        + e2b_full.section()
        + ("## Side by side with optimum-executorch\n\n"
           "Both as fresh `optimum-cli` processes on the same tiny model (import time included; peak RSS of the "
           "process): the demo Gemma4's config with one head layout on every layer (optimum-executorch sizes its KV "
           "cache from the global `num_key_value_heads`/`head_dim`, which the demo's mixed 32/64 head_dim does not "
           "have; every other trait on), random weights (benchmarks/peer.py). optimum-executorch 1.1.0 is installed "
           "with `--no-deps` beside this stack (it pins transformers 5.0.0rc1, which has no Gemma4); its XNNPACK "
           "recipe exports fp32 weights with no calibration and takes one token per call, so the like-for-like row "
           "is our fp16 decode-only export. Ratios are against the peer.\n\n" + peer_text + "\n\n"
           if peer_text else "")
        + "## Accuracy, size and runtime per quant scheme\n\n"
        f"Model: the demo Gemma4 (examples/tiny_gemma4.py: every trait on, trained on CPython's `pydoc_data.topics`), "
        f"hybrid, context {CONTEXT}, prefill {PREFILL}, SM8650, run on the x86 HTP emulator. CPU embedding tables: "
        "float for fp16, 8-bit per row otherwise.\n\n"
        "- export s / peak RSS MB: load to write, in-process (import not included).\n"
        "- size / bound: the .pte against parameters x bits (HTP weights at the scheme's width including the lm_head "
        "copy, embedding tables at theirs). These emulator builds have weight sharing off, so the prefill and decode "
        "graphs each hold the HTP weights: about 2x is expected; a phone build (weight sharing on) stores them once.\n"
        + (f"- PPL: perplexity on {rows[0]['eval tokens']} held-out tokens (docstrings of the standard-library modules "
           f"{', '.join(HELD_OUT_MODULES)}), fp32 Hugging Face vs the .pte, in windows of the context "
           "(`optimum-cli export qnn --evaluate`); SQNR and top-1 are the logits over the same tokens.\n" if rows else "")
        + "- decode SQNR: 91 tokens fed one by one through the decode method only, against fp32.\n"
        f"- greedy = HF: of {args.steps} new tokens, how many equal Hugging Face `generate` before the first difference, "
        "after the benchmark prompt (ids 40-71). greedy, held-out prompts: the same after each of "
        f"{GREEDY_PROMPTS} prompts of {GREEDY_PROMPT_TOKENS} tokens (BOS and the start of the docstring of "
        f"{', '.join(HELD_OUT_MODULES[:GREEDY_PROMPTS])}): their median, then each.\n"
        f"- TTFT, tok/s and host overhead (the share of a decode step spent outside the .pte's execute call): a 33-token "
        f"prompt, {args.steps} decode steps, median of {args.runs} runs. Emulator speed says nothing about a phone's "
        "speed.\n\n"
        + (scheme_table(rows, args.steps) if rows else "(no scheme run)") + "\n"
        + bench_section(results.get("bench"), results.get("weights"), args.steps)
        + IO_SECTION + io_bytes.table() + "\n"
    )
    (HERE / "RESULTS.md").write_text(text)
    print(text)
    return 0



if __name__ == "__main__":
    sys.exit(main())
