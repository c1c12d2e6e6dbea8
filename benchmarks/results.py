"""benchmarks/RESULTS.md, rendered from the stored rows alone: benchmarks/rows.json (run.py), e2b_full.json and
e4b_full.json (e2b_full.py), phone_size.json (phone_size.py), sensitivity_probe.json (sensitivity_probe.py),
chat_reuse.json (chat_reuse.py), lowering_profile.json (e2b_full.py --profile) and multi_soc.json (multi_soc.py). Nothing here
measures; stored.py holds the rows' reading and `lookup`, the row keys that README.md, CHANGELOG.md and docs/ quote.

Usage: python benchmarks/results.py   (writes benchmarks/RESULTS.md; run.py calls it after measuring)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import contexts  # noqa: E402
import e2b_full  # noqa: E402
import e2b_width  # noqa: E402
import io_bytes  # noqa: E402
import peer  # noqa: E402
import recipe  # noqa: E402
import speculative  # noqa: E402
from stored import markdown, stored  # noqa: E402
import tiny_gemma4  # noqa: E402
import weight_stats  # noqa: E402

RESULTS_FILE = HERE / "RESULTS.md"

FORMATS = {"host overhead": "{:.1%}", "top-1": "{:.3f}", "size / bound": "{:.2f}x", "PPL fp32": "{:.2f}", "PPL .pte": "{:.2f}"}


def scheme_table(rows: list[dict], steps: int) -> str:
    """One line per row; a column a row does not have (measured before the column existed) shows `-`."""
    header = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in ("eval tokens", "stages", "model", "commit")]
    header.append("commit")
    cells = []
    for row in rows:
        line = [row["scheme"]]
        for key in header[1:]:
            if key == "commit":
                line.append(row.get("commit", "not recorded"))
                continue
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


def runs_note(rows: list[dict]) -> str:
    """When a table's rows come from more than one run (their fp32 perplexities differ: another build of the model
    or of the held-out text), which rows belong together: figures compare only within one run."""
    runs: dict[str, list[str]] = {}
    for row in rows:
        runs.setdefault(f"{row['PPL fp32']:.2f}", []).append(row["scheme"])
    if len(runs) < 2:
        return ""
    groups = "; ".join(f"fp32 perplexity {ppl}: {', '.join(schemes)}" for ppl, schemes in runs.items())
    return (f"\nThese rows come from {len(runs)} measurement runs ({groups}); compare figures only among the rows of "
            "one run.\n")


def linear_params(weights: dict | None, model: str) -> float:
    """Parameters in a model's HTP linears: the sum over the linear classes of its weight-statistics rows."""
    return sum(row["params"] for row in (weights or {}).get(model, {}).values()) if weights else float("nan")


def bench_section(rows: list[dict] | None, weights: dict | None, steps: int) -> str:
    """The larger benchmark model's rows, and how heavy-tailed both models' weights are."""
    text = ""
    if rows:
        text += (
            "\n## The larger benchmark model: 16a8w, 16a4w_block and the 16a4w_e2b recipe\n\n"
            f"Model: examples/tiny_gemma4.py --size bench ({linear_params(weights, 'bench') / 1e6:.2f} M parameters in "
            "HTP linears, counting the lm_head's copy of the tied token table (the \"weights\" rows below); every Gemma4 "
            f"trait on; 8 layers, hidden 384, head_dim 64/128, vocabulary 2048; trained here for "
            f"{tiny_gemma4.SIZES['bench'].steps} steps), measured exactly as the demo model above (same calibration, "
            "held-out text, prompts and emulator).\n\n"
            + scheme_table(rows, steps) + "\n" + runs_note(rows)
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
    header = ["model", *[f"{s} s / GB" for s in recipe.STAGES], "total s", "peak GB"]

    def line(name: str, stages: dict[str, list[float]], total_s: float | None = None, peak: float | None = None) -> list[str]:
        cells = [name]
        for s in recipe.STAGES:
            if s not in stages:  # a stage the pipeline had not split out when the row was measured
                cells.append("-")
                continue
            sec, mb = stages[s]
            cells.append(f"{sec:.0f} / {mb / 1024:.1f}")
        total_s = sum(c[0] for c in stages.values()) if total_s is None else total_s
        peak = max(c[1] for c in stages.values()) / 1024 if peak is None else peak
        cells += [f"{total_s:.0f}", f"{peak:.1f}"]
        return cells

    rows, notes = [], []
    if demo is not None:
        rows.append(line(f"demo Gemma4 ({demo['scheme']}, hybrid, ctx {recipe.CONTEXT})", demo["stages"]))
    full_layers = e2b_width.depth_parameters(e2b_width.e2b_config())
    per_layer_params = full_layers / e2b_width.E2B_LAYERS
    xs = {}
    for r in e2b:
        xs[r["depth"]] = e2b_width.depth_parameters(e2b_width.e2b_config(r["depth"], recipe.DEPTHS[r["depth"]]))
        rows.append(line(f"E2B widths, {r['depth']} layers ({recipe.DEPTHS[r['depth']]} reuse KV)", r["stages"]))
    if len(e2b) >= 2:
        slope_row, extra_row = {}, {}
        for s in (s for s in recipe.STAGES if all(s in r["stages"] for r in e2b)):
            slope_t, at_t = fit_layers([(xs[r["depth"]], r["stages"][s][0]) for r in e2b], full_layers)
            slope_m, at_m = fit_layers([(xs[r["depth"]], r["stages"][s][1]) for r in e2b], full_layers)
            slope_row[s] = [slope_t * per_layer_params, slope_m * per_layer_params]
            extra_row[s] = [at_t, at_m]
        rows.append(line("per E2B layer (fit, see below)", slope_row, peak=max(v[1] for v in slope_row.values()) / 1024))
        rows.append(line("**extrapolated: E2B, 35 layers**", extra_row))
        total = sum(v[0] for v in extra_row.values())
        peak = max(v[1] for v in extra_row.values()) / 1024
        notes.append(
            f"Extrapolated full Gemma-4-E2B export ({recipe.E2B_SCHEME}, hybrid, weights shared, "
            f"{e2b_width.E2B_LAYERS // recipe.E2B_LAYERS_PER_SHARD} shards): about {total / 60:.0f} min and "
            f"{peak:.1f} GB peak RSS. This is an extrapolation, not a measurement. The rows of this table were "
            "measured on an earlier pipeline (before the bf16 weights kept in the checkpoint's pages, the parallel shard "
            "compiles and the streamed program); the full-size measurements below supersede the extrapolation."
        )
    return markdown(header, rows), notes


def peer_table(ours: dict[str, peer.ProcessCost], theirs: peer.ProcessCost) -> str:
    header = ["exporter", "what it builds", "wall s", "peak RSS MB", "wall / peer", "RSS / peer"]
    rows = [[f"optimum-executorch 1.1.0 `--recipe xnnpack --max_seq_len {recipe.CONTEXT}`", "XNNPACK fp32, one token per call",
             f"{theirs.wall_s:.0f}", f"{theirs.peak_rss_mb:.0f}", "1.00x", "1.00x"]]
    for what, cost in ours.items():
        rows.append(["optimum-qnn `export qnn`", what, f"{cost.wall_s:.0f}", f"{cost.peak_rss_mb:.0f}",
                     f"{cost.wall_s / theirs.wall_s:.2f}x", f"{cost.peak_rss_mb / theirs.peak_rss_mb:.2f}x"])
    return markdown(header, rows)


IO_SECTION = (
    "\n## Graph IO per call at Gemma-4-E2B widths\n\n"
    "What crosses the graph boundary per call (benchmarks/io_bytes.py; sizes from the runner contract of E2B's "
    "published text config, prefill 128, so exact rather than sampled): quantized exports pass the masks, KV caches "
    "and logits as uint16 (the default), `--float-io` as float32.\n\n"
)


def render(results: dict) -> str:
    """RESULTS.md's text from benchmarks/rows.json's content (and the other stored rows)."""
    minutes = results["minutes"]
    rows, e2b = results["schemes"], results["e2b"]
    settings = results.get("settings") or {"steps": 32, "runs": 2}  # the defaults the older rows were measured with
    steps, runs = settings["steps"], settings["runs"]
    theirs = peer.ProcessCost(**results["peer"]["theirs"])
    peer_text = peer_table({k: peer.ProcessCost(**v) for k, v in results["peer"]["ours"].items()}, theirs)
    demo_cost = next((r for r in rows if r["scheme"] == "16a8w"), rows[0] if rows else None)
    cost_text, notes = cost_tables(demo_cost, e2b)
    text = (
        "# Benchmarks\n\n"
        f"Machine: {results['machine']}. Every figure below is rendered from a stored row (benchmarks/rows.json, "
        "e2b_full.json, e4b_full.json, phone_size.json, sensitivity_probe.json, chat_reuse.json, lowering_profile.json, multi_soc.json, matrix.json, contexts.json, speculative.json) by benchmarks/results.py; a row's `commit` column is "
        "the commit it was measured on (`not recorded`: measured before rows recorded it). "
        "Minutes per section (`make bench` runs all; `--sections` re-measures some and keeps the others' rows from "
        f"benchmarks/rows.json): {', '.join(f'{k} {v:.1f}' for k, v in minutes.items())}.\n\n"
        "## Export cost per stage\n\n"
        "Wall seconds and the highest RSS of the export process while the stage ran (sampled every 50 ms), from load "
        "to write; each export runs in its own process. `edge` is the SoC-independent half of the lowering (ExecuTorch's "
        "edge passes and partitioning, once per export since 866bf35); a row measured before that has the whole "
        "lowering under `lower` and `-` under `edge`.\n\n"
        f"- demo Gemma4: examples/tiny_gemma4.py (every trait on, {rows and 'trained here'}), SM8650.\n"
        f"- E2B widths: benchmarks/e2b_width.py, Gemma-4-E2B's real widths (hidden 1536, 8 heads, 1 KV head, "
        "head_dim 256/512, MLP 6144/12288, vocab 262144, per-layer embeddings 256 per layer) with random bf16 "
        f"weights at reduced depth; {recipe.E2B_SCHEME}, hybrid (prefill {recipe.E2B_PREFILL} + decode), context {recipe.E2B_CONTEXT}, "
        "weights shared between the two graphs (the phone build), 4-bit embedding tables, SM8650, calibration on "
        f"random ids (no tokenizer), `--shards` = layers / {recipe.E2B_LAYERS_PER_SHARD} (one HTP context per "
        f"{recipe.E2B_LAYERS_PER_SHARD} layer(s)). The stored rows ran before the commit column existed and before shards "
        "compiled in worker processes (82f485a): their shards compiled one at a time.\n"
        "- per E2B layer: the slope of a line through the measured depths against the parameters that grow with "
        "depth (decoder layers, and the per-layer embedding table, 256 columns per layer), times those of an "
        "average E2B layer (120 M: 53 M in the layer, KV-reusing layers having a double-wide MLP, and 67 M of "
        "table). The extrapolated row is that line at E2B's 35 layers (4.21 B such parameters); the token table "
        "and lm_head are in the intercept. Peak RSS is fitted per stage and the maximum taken. It is an "
        "extrapolation from two depths, not a measurement.\n\n"
        + cost_text + "\n\n" + "".join(f"{n}\n\n" for n in notes)
        + e2b_full.section("e2b") + e2b_full.section("e4b")
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
        f"hybrid, context {recipe.CONTEXT}, prefill {recipe.PREFILL}, SM8650, run on the x86 HTP emulator. CPU embedding tables: "
        "float for fp16, 8-bit per row otherwise.\n\n"
        "- export s / peak RSS MB: load to write, in-process (import not included).\n"
        "- size / bound: the .pte against parameters x bits (HTP weights at the scheme's width including the lm_head "
        "copy, embedding tables at theirs). These emulator builds have weight sharing off, so the prefill and decode "
        "graphs each hold the HTP weights: about 2x is expected; a phone build (weight sharing on) stores them once.\n"
        + (f"- PPL: perplexity on {rows[0]['eval tokens']} held-out tokens (docstrings of the standard-library modules "
           f"{', '.join(recipe.HELD_OUT_MODULES)}), fp32 Hugging Face vs the .pte, in windows of the context "
           "(`optimum-cli export qnn --evaluate`); SQNR and top-1 are the logits over the same tokens.\n" if rows else "")
        + "- decode SQNR: 91 tokens fed one by one through the decode method only, against fp32.\n"
        f"- greedy = HF: of {steps} new tokens, how many equal Hugging Face `generate` before the first difference, "
        "after the benchmark prompt (ids 40-71). greedy, held-out prompts: the same after each of "
        f"{recipe.GREEDY_PROMPTS} prompts of {recipe.GREEDY_PROMPT_TOKENS} tokens (BOS and the start of the docstring of "
        f"{', '.join(recipe.HELD_OUT_MODULES[:recipe.GREEDY_PROMPTS])}): their median, then each.\n"
        f"- TTFT, tok/s and host overhead (the share of a decode step spent outside the .pte's execute call): a 33-token "
        f"prompt, {steps} decode steps, median of {runs} runs. Emulator speed says nothing about a phone's "
        "speed.\n\n"
        + (scheme_table(rows, steps) + "\n" + runs_note(rows) if rows else "(no scheme run)\n")
        + bench_section(results.get("bench"), results.get("weights"), steps)
        + phone_section(stored("phone_size.json")) + probe_section(stored("sensitivity_probe.json"))
        + chat_section(stored("chat_reuse.json")) + profile_section(stored("lowering_profile.json"))
        + multi_soc_section(stored("multi_soc.json")) + matrix_section(stored("matrix.json"))
        + runtimes_section(stored("ort_vs_executorch.json"))
        + generate_section(stored("ort_vs_executorch_e2b.json")) + contexts.section(stored("contexts.json"))
        + speculative.section(stored("speculative.json"))
        + IO_SECTION + io_bytes.table() + "\n"
    )
    return text


def phone_section(rows: dict) -> str:
    """The phone build's size (weights shared) per model and scheme, against the first scheme measured."""
    if not rows:
        return ""
    lines = []
    for model, schemes in rows.items():
        for scheme, row in schemes.items():
            lines.append([model, scheme, f"{row['phone .pte KB']:.1f}",
                          f"{row['ratio to first scheme']:.3f}x (/ {row['first scheme']})", row.get("commit", "not recorded")])
    return (
        "\n## Phone build size (weights shared)\n\n"
        "benchmarks/phone_size.py: the same exports as above with weight sharing on (the build a phone gets, which "
        "the x86 emulator cannot load), so the HTP weights are stored once; the ratio is against plain 16a4w_block "
        "of the same model.\n\n"
        + markdown(["model", "scheme", "phone .pte KB", "size against", "commit"], lines) + "\n"
    )


def runtimes_section(rows: dict) -> str:
    """Seconds per call, load and peak RSS of one variant in onnxruntime-qnn against ExecuTorch's runtime."""
    if not rows:
        return ""
    by = {r["runtime"]: r for r in rows["rows"]}
    ort, et = by["onnxruntime"], by["executorch"]
    lines = [[f"{m} s/call (median)", f"{ort['methods'][m]['median_s']:.3f}", f"{et['methods'][m]['median_s']:.3f}",
              f"{ort['methods'][m]['median_s'] / et['methods'][m]['median_s']:.2f}"] for m in ort["methods"]]
    lines += [[f"{m} s/call, taking turns in one process", f"{v['onnxruntime_s']:.3f}", f"{v['executorch_s']:.3f}",
               f"{v['onnxruntime_s'] / v['executorch_s']:.2f}"] for m, v in rows["interleaved"].items()]
    lines += [["load s", f"{ort['load_s']:.2f}", f"{et['load_s']:.2f}", f"{ort['load_s'] / et['load_s']:.2f}"],
              ["peak RSS MB", f"{ort['peak_rss_mb']:.0f}", f"{et['peak_rss_mb']:.0f}",
               f"{ort['peak_rss_mb'] / et['peak_rss_mb']:.2f}"]]
    return (
        "\n## The two in-process runtimes\n\n"
        "benchmarks/ort_vs_executorch.py: the demo export (16a8w hybrid, context 128) on the x86 HTP emulator, each "
        "runtime in its own child process, one after the other (ExecuTorch's load includes importing torch), then both "
        f"in one process taking turns; outputs byte-identical: {rows.get('identical')}.\n\n"
        + markdown(["", "onnxruntime", "ExecuTorch", "ratio"], lines) + "\n"
    )


def generate_section(rows: dict) -> str:
    """A full-size export generating through both in-process runtimes (ort_vs_executorch.py --generate)."""
    if not rows:
        return ""
    by = {r["runtime"]: r for r in rows["generate"]}
    ort, et = by["onnxruntime"], by["executorch"]
    lines = [[label, f"{ort[key]:{fmt}}", f"{et[key]:{fmt}}", f"{ort[key] / et[key]:.2f}"]
             for key, label, fmt in (("load_s", "load s", ".1f"), ("ttft_s", "first token s", ".2f"),
                                     ("decode_s_per_token", "decode s/token (median)", ".2f"),
                                     ("peak_rss_mb", "peak RSS MB", ".0f"))]
    return (
        "\n### A full-size Gemma-4-E2B export through both runtimes\n\n"
        f"benchmarks/ort_vs_executorch.py --generate: {rows['note']} The same {len(ort['tokens'])} tokens through both: "
        f"{rows['identical']}.\n\n" + markdown(["", "onnxruntime", "ExecuTorch", "ratio"], lines) + "\n"
    )


def chat_section(rows: dict) -> str:
    """A conversation's time to first token per turn, with the cache kept against a full re-prefill."""
    if not rows:
        return ""
    lines = [[str(t["turn"]), str(t["prompt_tokens"]), str(t["reused_tokens"]), str(t["prefilled_tokens"]),
              f"{t['ttft_reuse_s']:.3f}", f"{t['ttft_full_s']:.3f}", f"{t['ratio']:.2f}x"] for t in rows["turns"]]
    return (
        "\n## Conversations: time to first token with the cache kept\n\n"
        f"benchmarks/chat_reuse.py ({rows['model']}, {rows['export']}, commit {rows['commit']}): one 5-turn "
        f"conversation through `model.chat()` (each turn prefills only its own tokens; replies of up to "
        f"{rows['reply_tokens']} tokens), then each turn's whole prompt through `generate` from an empty cache, in "
        f"the same run; medians of {rows['repeats']} conversations. The ratio is reuse / full re-prefill.\n\n"
        + markdown(["turn", "prompt tokens", "reused", "prefilled", "first token, reuse (s)",
                    "first token, full prefill (s)", "ratio"], lines) + "\n"
    )


def _runs_section(rows: dict, heading: str, run_text) -> str:
    """A section over a row file's ``runs``: the heading (with its intro), then ``run_text(label, run)`` for each."""
    if not rows:
        return ""
    return heading + "".join(run_text(label, run) for label, run in rows["runs"].items())


def profile_section(rows: dict) -> str:
    """Profiled exports (benchmarks/e2b_full.py --profile): CPU seconds by stage and by step, from py-spy samples."""

    def run_text(label: str, run: dict) -> str:
        stages = ", ".join(f"{st['name']} {st['wall_s']:.0f} s" for st in run["stages"])
        cpu = (f"{run['cpu_percent']}% CPU (/usr/bin/time)" if run.get("cpu_percent") is not None else
               f"{100 * run['sampled_cpu_s'] / run['wall_s']:.0f}% CPU (sampled CPU s / wall s)")
        return (f"\n### {label} (commit {run['commit']})\n\nWall {run['wall_s']:.0f} s at {cpu}; stages: {stages}.\n\n"
                + markdown(["process", "stage", "CPU s"],
                           [[r["process"], r["stage"], f"{r['cpu_s']:.0f}"] for r in run["by_stage"] if r["cpu_s"] >= 1])
                + "\n\n" + markdown(["process", "stage", "step (outermost pass, partitioner, builder or serializer)", "CPU s"],
                                     [[r["process"], r["stage"], f"`{r['step']}`", f"{r['cpu_s']:.0f}"]
                                      for r in run["steps"][:20]]) + "\n")

    return _runs_section(rows, "\n## Where an export's CPU time goes\n\n"
                         "benchmarks/e2b_full.py --profile: the export sampled by py-spy (every process, the forked shard "
                         "compiles included; waiting threads left out), attributed by benchmarks/lowering_profile.py. CPU "
                         "seconds are samples / rate; 200% CPU = both cores busy all the time.\n", run_text)


def multi_soc_section(rows: dict) -> str:
    """One export for four SoCs: what each SoC adds, against the first SoC's whole export."""

    def run_text(label: str, run: dict) -> str:
        if "exports" in run:  # the first 1..4 SoCs, one export each (lowered side by side where they fit)
            marginals = ["-", *(f"{row['marginal']:.2f}x" for row in run["socs"])]
            return (f"\n{label} (commit {run['commit']}): **an extra SoC costs {run['marginal']:.2f}x** of the first SoC's "
                    "export on average.\n\n"
                    + markdown(["SoCs", "export (s)", "the last SoC's marginal cost"],
                               [[" ".join(e["socs"]), f"{e['export_s']:.1f}", m] for e, m in zip(run["exports"], marginals)])
                    + "\n\nThe four-SoC export's lowering, by wave:\n\n"
                    + markdown(["SoCs lowered at once", "lower stage (s)"],
                               [[" + ".join(w["socs"]), f"{w['lower_s']:.1f}"] for w in run["waves"]]) + "\n")
        return (f"\n{label} (commit {run['commit']}): shared stages {run['shared_s']:.1f} s, first SoC's whole export "
                f"{run['first_soc_export_s']:.1f} s, wall {run['wall_s']:.0f} s.\n\n"
                + markdown(["SoC", "its lower + inspect + write (s)", "marginal"],
                           [[r["soc"], f"{r['own_s']:.1f}", f"{r['marginal']:.2f}x"] for r in run["socs"]]) + "\n")

    return _runs_section(rows, "\n## One export, four SoCs: the cost of each extra SoC\n\n"
                         "benchmarks/multi_soc.py: `optimum-cli export qnn --soc SM8550 SM8650 SM8750 SM8850` (default flags "
                         "otherwise); load, calibration and quantization run once, then each SoC is lowered, inspected and "
                         "written. Rows with a table of exports (from side-by-side lowering on): four exports, of the first "
                         "1, 2, 3 and 4 SoCs, each timed as the sum of its stages; the k-th SoC's marginal cost is the "
                         "export of k SoCs less the export of k - 1, over the export of the first alone. Rows labelled `one SoC after the other` lowered the SoCs in "
                         "turn, and an SoC's marginal cost there is its own stages over the first SoC's whole export (the "
                         "shared stages plus its own). From 866bf35 the lowering's SoC-independent half (re-export, QNN's passes, "
                         "edge conversion: the `edge` stage) is one of the shared stages, and an SoC's own lowering is "
                         "its partitioning, HTP compile and serialization; the rows labelled `before 866bf35` ran the "
                         "whole lowering per SoC.\n", run_text)


def matrix_section(rows: dict) -> str:
    """The export matrix: measured at small scale (here and on a loopback Ray cluster), and on paper at full scale."""
    import matrix

    def run_text(label: str, run: dict) -> str:
        cells = ", ".join(f"{c['cell']} {c['s']:.1f} s" for c in run.get("cells", ()))
        return (f"\n{label} (commit {run['commit']}): wall {run['wall_s']:.1f} s; driver stages {run['driver']:.1f} s, "
                f"lowering {run['lower']:.1f} s, inspect + write {run['write']:.1f} s"
                + (f"; cells {cells}; the formula below on this run's own parts: {run['formula_s']:.1f} s"
                   if cells else "") + ".\n")

    paper = matrix.paper()
    table = markdown(
        ["model", "source row", "D s", "C s", "W s", *(f"{n} node(s), s" for n in matrix.PAPER_NODES)],
        [[e["model"], e["row"], f"{e['D']:.0f}", f"{e['C']:.0f}", f"{e['W']:.0f}",
          *(str(e[f"{n} nodes"]) for n in matrix.PAPER_NODES)] for e in paper],
    )
    return _runs_section(rows, "\n## The export matrix: schemes x SoCs, on one machine and on a Ray cluster\n\n"
                         "benchmarks/matrix.py measure: the demo model, `--soc SM8650 SM8750 --quant 16a8w 16a4w`, here and "
                         "with `--ray` on a 2-node cluster on loopback (both nodes on this machine's 2 cores: the row "
                         "measures each cell's cost and the cluster's overhead, not a speed-up). A Ray cell converts the "
                         "graphs for QNN itself (the edge programs do not serialize), so its lowering includes what the "
                         "local export's `edge` stage does once per scheme.\n", run_text) + (
        "\nOn paper (estimates from the measured full-size single-SoC stages named, 2 schemes x 4 phone SoCs): "
        "N nodes take S x D + ceil(S x K / N) x C + S x K x W, with D the driver's stages per scheme (load to "
        "quantize), C one SoC's lowering (edge conversion included, as a cell runs it) and W its inspect and write "
        "on the driver; 1 node is every SoC lowered in full, an upper bound of a local export, which converts the "
        "graphs once per scheme.\n\n" + table + "\n"
    )


def probe_section(rows: dict) -> str:
    """The sensitivity plan's random probes against the exact plan (one model pass per linear)."""
    if not rows:
        return ""
    lines = [[model, method, r["passes"], f"{r['s']:.0f}", f"{r['Spearman vs exact']:.3f}",
              f"{r['kept']} ({r['kept as exact']})", f"{r['held-out SQNR dB']:.2f}", r.get("commit", "not recorded")]
             for model, methods in rows.items() for method, r in methods.items()]
    return (
        "\n## Sensitivity plan: random probes against the exact plan\n\n"
        "benchmarks/sensitivity_probe.py (HF eager fp32, 4 windows of 128 calibration tokens, 4-bit block-64 "
        "rounding): Spearman rank correlation of noise per parameter with the exact plan's, the linears each plan "
        "keeps at 8 bits within 25% (in brackets: as the exact plan), and the held-out logits SQNR of that plan's "
        "weights (weight-only, the rest 4-bit).\n\n"
        + markdown(["model", "method", "passes (forward + backward)", "s", "Spearman vs exact", "kept (same as exact)",
                    "held-out SQNR dB", "commit"], lines) + "\n"
    )


def write() -> str:
    """Render RESULTS.md from the stored rows, write it, and return its text."""
    text = render(stored("rows.json"))
    RESULTS_FILE.write_text(text)
    return text


if __name__ == "__main__":
    write()
    print(f"wrote {RESULTS_FILE}")
