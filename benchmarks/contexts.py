"""Context length, measured: full-size Gemma-4-E2B/E4B exports at 4096, 8192 and 32768 tokens, and the demo model's
emulator seconds per call against its context.

`export` runs `optimum-cli export qnn` (benchmarks/e2b_full.run_export: the command users type, under
`/usr/bin/time -v`, in a 16 GB memory cgroup) for one context and stores its row in benchmarks/contexts.json: exit
status (the refusal's words when the preflight refused), wall time, peak memory, `.pte` size, each HTP graph's memory
needs as `inspect` reads them (spill-fill buffer, IO buffers, op data), and the bytes that cross the graph boundary
per decode and per prefill call (exact, from the variant's runner contract). `emulator` exports the demo model at
several contexts (16a8w, weights not shared) and times decode and prefill calls on the x86 HTP emulator through
the onnxruntime backend. `generate` loads one full-size variant as a user does (an unshared export: the emulator
cannot load weight-shared contexts) and generates greedily through the onnxruntime backend on the emulator: load
time, the first token, seconds per decode call, peak memory; with `--reference`, how many of its first tokens are
another run's on the same seeded prompt (stored with the row, not rendered: with random weights two quantized
exports pick apart). `render` prints the tables RESULTS.md shows (benchmarks/results.py includes them).

The SM8750 figure is an ESTIMATE, not a measurement: a decode step reads every cache input and writes the new
column; at the SoC's peak DRAM bandwidth (LPDDR5X at 5300 MHz on a 64-bit bus: 84.8 GB/s) the cache traffic alone
costs bytes / 84.8 GB/s. Real HTP reads reach a fraction of the peak, so the real cost is higher; the ratio to the
weights' own read (the HTP contexts' bytes, read once per step) is what the table is for.

Run the exports alone (each needs most of the machine's memory for 10-20 min):
    python benchmarks/contexts.py export --model e2b --context 4096   # or 'default': no --max-seq-len
    python benchmarks/contexts.py emulator --contexts 128 256 512 1024
    python benchmarks/contexts.py emulator --contexts 256 512 1024 --layouts full blocks128 blocks256
    python benchmarks/contexts.py generate --variant <out>/qnn/sm8650/16a4w_block64-ctx32768-blocks --tokens 8 \
        --reference benchmarks/ort_vs_executorch_e2b.json
    python benchmarks/contexts.py render
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

ROWS = HERE / "contexts.json"
SM8750_PEAK_GBPS = 84.8  # LPDDR5X-5300 (5300 MHz, double data rate) x 64-bit bus = 84.8 GB/s


def _load() -> dict:
    return json.loads(ROWS.read_text()) if ROWS.is_file() else {"exports": {}, "emulator": {}}


def _store(section: str, key: str, row: dict) -> None:
    rows = _load()
    rows.setdefault(section, {})[key] = row
    ROWS.write_text(json.dumps(rows, indent=1) + "\n")


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(HERE), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def call_bytes(contract) -> dict[str, dict[str, int]]:
    """Bytes in and out of each method per call, and the KV caches' share of the inputs (the runner contract)."""
    from io_bytes import tensor_bytes

    return {m.name: {"in": tensor_bytes(m.inputs), "out": tensor_bytes(m.outputs),
                     "kv_in": tensor_bytes(t for t in m.inputs if "cache" in t.name), "ar": m.ar_len}
            for m in contract.methods}


def graph_needs(pte: Path) -> dict:
    """Each HTP graph's memory needs as `inspect` reads them, summed over the shards: spill-fill, IO, op data."""
    from optimum_qnn.artifacts.inspection import inspect_pte

    needs: dict[str, dict[str, int]] = {}
    for context in inspect_pte(pte).contexts:
        for g in context.graphs:
            method = g.name.split("_shard")[0] if "_shard" in g.name else g.name
            row = needs.setdefault(method, {"spill_fill": 0, "io": 0, "op_data": 0, "weights": 0, "graphs": 0})
            row["graphs"] += 1
            row["weights"] += g.shared_weights_bytes or g.const_bytes or 0  # what one call of the graph reads
            for key, value in (("spill_fill", g.spill_fill_bytes), ("io", g.io_bytes), ("op_data", g.op_data_bytes)):
                row[key] += value or 0
    return needs


def export_row(model: str, context: str, extra: list[str], memory_limit: float, from_work: Path | None = None,
               commit: str | None = None) -> dict:
    """Run the export (or read the one already run into ``from_work``: its result.json, out.log and out/) and
    return its row."""
    import e2b_full

    from optimum_qnn.artifacts.manifest import read_manifest

    work = from_work or Path(f"/tmp/contexts-{model}-{context}")
    flags = ([] if context == "default" else ["--max-seq-len", context]) + extra
    commit = commit or _commit()  # the code the export runs, before anything else changes the tree
    if from_work is None:
        folder = e2b_full.build(e2b_full.CACHE / "bench-models" / e2b_full.MODELS[model][1], model=model)
        result = e2b_full.run_export(folder, work / "out", "SM8650", "16a4w_block", flags, memory_limit, allow_failure=True)
        (work / "result.json").write_text(json.dumps(result, indent=1))
    else:
        result = json.loads((work / "result.json").read_text())
    row = {"model": model, "context": context, "flags": flags, "commit": commit, "memory_limit_gb": memory_limit,
           "exit": result.get("failed", 0), "wall_s": round(result["wall_s"], 1),
           "max_rss_gb": result.get("max_rss_gb"), "cgroup_peak_gb": result.get("cgroup_peak_gb"),
           "cpu_percent": result.get("cpu_percent"), "stages": result["stages"],
           "anonymous_gb": result.get("anonymous_gb")}  # per stage: the part of the RSS the kernel cannot take back
    if row["exit"]:
        log = (work / "out.log").read_text()
        row["error"] = next((line for line in log.splitlines() if line.startswith("error:")), result.get("log_tail", "")[-600:])
        return row
    pte = Path(result["pte"])
    manifest = read_manifest(pte.parent)
    contract = manifest.runner_contract()
    row.update(pte_gb=result["pte_gb"], htp_gb=result["components"].get("htp_contexts"), context_len=contract.context_len,
               cache_layout=getattr(contract, "cache_layout", None) and str(contract.cache_layout.value),
               calls=call_bytes(contract), graphs=graph_needs(pte))
    return row


def emulator_rows(contexts: list[int], calls: int, work: Path, layouts: list[str]) -> Iterator[dict]:
    """The demo variant at each context and cache layout (``full``, or ``blocksN``: blocks of N slots; none as long
    as the context), its decode and prefill calls timed on the x86 HTP emulator through the onnxruntime backend
    (benchmarks/ort_vs_executorch.child: random runner-contract inputs, the median of ``calls``), one row at a time."""
    import ort_vs_executorch

    for context in contexts:
        for layout in layouts:
            block_len = None if layout == "full" else int(layout.removeprefix("blocks"))
            if block_len is not None and block_len >= context:
                continue
            folder = f"demo-{context}" + ("" if block_len is None else f"-blocks{block_len}")
            variant = ort_vs_executorch.build_demo_variant(work / folder, context, block_len)
            timed = ort_vs_executorch.child("onnxruntime", variant, {"kv_forward": calls, "prefill_forward": max(3, calls // 4)})
            row = {"context": context, "layout": layout, "decode_s": timed["methods"]["kv_forward"]["median_s"],
                   "prefill_s": timed["methods"]["prefill_forward"]["median_s"], "calls": calls}
            print(f"context {context} {layout}: prefill {row['prefill_s']:.3f} s/call, decode {row['decode_s']:.4f} s/call",
                  flush=True)
            yield row


def generate_row(variant: Path, tokens: int, reference: Path | None) -> dict:
    """``variant`` generating ``tokens`` greedily through the onnxruntime backend on the emulator, in a fresh process
    (benchmarks/ort_vs_executorch.generate_child: the seeded 8-id prompt, one prefill call); its tokens against the
    ``reference`` run's (a --generate JSON of ort_vs_executorch.py) when given."""
    from optimum_qnn.artifacts.manifest import read_manifest

    manifest = read_manifest(variant)
    proc = subprocess.run([sys.executable, str(HERE / "ort_vs_executorch.py"), "--child", "onnxruntime", "--variant",
                           str(variant), "--generate", str(tokens)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the generating child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    contract = manifest.contract
    row = {"model": manifest.source.model_id, "context": contract.context_len,
           "layout": str(getattr(contract.cache_layout, "value", contract.cache_layout)),
           "pte_gb": (variant / "model.pte").stat().st_size / 1e9, **got}
    if reference is not None and reference.is_file():
        ref = json.loads(reference.read_text())
        ref_tokens = ref["generate"][0]["tokens"]
        same = 0
        for a, b in zip(got["tokens"], ref_tokens):
            if a != b:
                break
            same += 1
        row["reference"] = {"file": reference.name, "context": ref.get("context", 4096), "tokens": ref_tokens,
                            "same_prefix": same}
    return row


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def estimate_ms(bytes_: int) -> float:
    """ESTIMATE: milliseconds to move ``bytes_`` at SM8750's peak DRAM bandwidth."""
    return bytes_ / (SM8750_PEAK_GBPS * 1e9) * 1e3


def section(rows: dict) -> str:
    """The markdown RESULTS.md shows: one row per full-size export, then the emulator's seconds per call."""
    exports = rows.get("exports", {})
    if not exports:
        return ""
    lines = [
        "\n## Context length: full-size exports at 4K to 32K\n",
        "benchmarks/contexts.py: `optimum-cli export qnn --soc SM8650 --quant 16a4w_block` on the random full-size "
        "checkpoint (benchmarks/e2b_full.py), in a 16 GB memory cgroup, one context per run. KV MiB: the cache inputs "
        "of one call (uint16; float32 with --float-io); spill-fill / IO / op data: the HTP graphs' own needs as `inspect` reads them, summed "
        "over the shards. **SM8750 ms (estimate)**: the decode call's cache bytes in and out at SM8750's peak DRAM "
        f"bandwidth ({SM8750_PEAK_GBPS} GB/s, LPDDR5X-5300 x 64 bit); the weights' own read per step beside it (HTP "
        "contexts' bytes at the same bandwidth). A lower bound: the HTP reaches a fraction of the peak.\n",
        "| model | context | flags | exit | wall s | peak RSS GB | .pte GB | decode KV MiB in | decode MiB in/out "
        "| prefill MiB in/out | spill-fill MiB | decode IO / op data MiB | SM8750 ms: cache / weights (estimate) | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in exports.items():
        flags = " ".join(r["flags"]) or "(none)"
        peak = r.get("max_rss_gb")  # the export's peak RSS (the cgroup's own peak counts the page cache it filled)
        peak_text = "-" if peak is None else f"{peak:.1f}"
        if r["exit"]:
            lines.append(f"| {r['model']} | {r['context']} | `{flags}` | {r['exit']} | {r['wall_s']:.0f} | {peak_text} | - "
                         f"| - | - | - | - | - | - | {r['commit']} |")
            continue
        calls = r["calls"]
        decode = calls.get("kv_forward") or next(iter(calls.values()))
        prefill = calls.get("prefill_forward")
        graphs = r["graphs"]
        dg = next((v for k, v in graphs.items() if k.startswith("kv_forward")), None) or {}
        spill = sum(g["spill_fill"] for g in graphs.values())
        cache_ms = estimate_ms(decode["kv_in"] + decode["out"])
        weights_ms = estimate_ms(dg.get("weights", 0))
        lines.append(
            f"| {r['model']} | {r['context_len']} | `{flags}` | 0 | {r['wall_s']:.0f} | {peak_text} | {r['pte_gb']:.2f} "
            f"| {_mib(decode['kv_in'])} | {_mib(decode['in'])} / {_mib(decode['out'])} "
            f"| {_mib(prefill['in']) if prefill else '-'} / {_mib(prefill['out']) if prefill else '-'} | {_mib(spill)} "
            f"| {_mib(dg.get('io'))} / {_mib(dg.get('op_data'))} | {cache_ms:.2f} / {weights_ms:.1f} | {r['commit']} |"
        )
    for r in exports.values():
        if r.get("note"):
            lines.append(f"\n{r['model']} at {r['context']}: {r['note']}")
    refused = [r for r in exports.values() if r["exit"] and r.get("error")]
    for r in refused:
        lines.append(f"\n{r['model']} at {r['context']} (`{' '.join(r['flags'])}`), exit {r['exit']} after "
                     f"{r['wall_s']:.0f} s: {r['error']}")
    generated = rows.get("generate", {})
    if generated:
        lines += ["", "Full-size variants generating on the x86 HTP emulator (benchmarks/contexts.py generate: the "
                  "variant loaded as a user loads it, through the onnxruntime backend; a seeded 8-id prompt, one "
                  "prefill call, greedy; unshared exports, as the emulator cannot load weight-shared contexts). The "
                  "emulator runs every HTP op on the x86 CPU: its seconds are not a phone's.", "",
                  "| model | context | layout | .pte GB | load s | first token s | decode s/token | peak RSS MB | tokens "
                  "| commit |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in generated.values():
            lines.append(f"| {r['model']} | {r['context']} | {r['layout']} | {r['pte_gb']:.2f} | {r['load_s']:.1f} "
                         f"| {r['ttft_s']:.0f} | {r['decode_s_per_token']:.0f} | {r['peak_rss_mb']:.0f} "
                         f"| {len(r['tokens'])} | {r['commit']} |")
        for r in generated.values():
            if r.get("note"):
                lines.append(f"\n{r['model']} at {r['context']} on the emulator: {r['note']}")
    emulator = rows.get("emulator", {})
    if emulator:
        lines += ["", "The demo model (16a8w, weights not shared) on the x86 HTP emulator through the onnxruntime "
                  "backend, the median seconds per call (prefill: 16 tokens a call), by cache layout (`blocksN`: "
                  "each full-attention cache in inputs of N slots; the sliding layers' ring of 16 either way). Rows "
                  "with a note were measured beside other work on a shared 2-core host: compare rows of one commit.", "",
                  "| context | layout | prefill s/call | decode s/call | commit | note |", "|---|---|---|---|---|---|"]
        for r in sorted(emulator.values(), key=lambda r: (r["context"], r.get("layout", "full") != "full", r.get("layout", ""))):
            lines.append(f"| {r['context']} | {r.get('layout', 'full')} | {r['prefill_s']:.3f} | {r['decode_s']:.4f} "
                         f"| {r['commit']} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export")
    p.add_argument("--model", choices=("e2b", "e4b"), default="e2b")
    p.add_argument("--context", required=True, help="a --max-seq-len, or 'default' (no flag)")
    p.add_argument("--memory-limit", type=float, default=16.0)
    p.add_argument("--from-work", type=Path, help="store the row of an export already run into this folder")
    p.add_argument("--commit", help="with --from-work: the commit that export ran")
    p.add_argument("--note", help="what the row should say beside it (e.g. what else ran then)")
    p.add_argument("extra", nargs="*", help="more export flags (after --)")
    e = sub.add_parser("emulator")
    e.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024])
    e.add_argument("--calls", type=int, default=20)
    e.add_argument("--work", type=Path, default=Path("/tmp/contexts-demo"))
    e.add_argument("--layouts", nargs="+", default=["full"], help="cache layouts: full, or blocksN (blocks of N slots)")
    e.add_argument("--note", help="what the rows should say beside them (e.g. what else ran then)")
    g = sub.add_parser("generate")
    g.add_argument("--variant", type=Path, required=True, help="an unshared variant folder (manifest.json + model.pte)")
    g.add_argument("--tokens", type=int, default=8)
    g.add_argument("--reference", type=Path,
                   help="a --generate run of ort_vs_executorch.py on the same model and prompt to compare tokens with "
                        "(benchmarks/ort_vs_executorch_e2b.json: the E2B 4K variant)")
    g.add_argument("--note", help="what the row should say beside it")
    sub.add_parser("render")
    args = parser.parse_args()
    if args.command == "export":
        row = export_row(args.model, args.context, args.extra, args.memory_limit, args.from_work, args.commit)
        if args.note:
            row["note"] = args.note
        key = f"{args.model}@{args.context}" + (" " + " ".join(args.extra) if args.extra else "")
        _store("exports", key, row)
    elif args.command == "emulator":
        bad = [layout for layout in args.layouts if layout != "full" and not layout.removeprefix("blocks").isdigit()]
        if bad:
            parser.error(f"unknown layout {bad[0]!r}; expected full or blocksN (e.g. blocks128)")
        commit = _commit()  # the code that runs, before the first stored row makes the tree dirty
        for row in emulator_rows(args.contexts, args.calls, args.work, args.layouts):
            row["commit"] = commit
            if args.note:
                row["note"] = args.note
            _store("emulator", f"{row['context']} {row['layout']}", row)
    elif args.command == "generate":
        commit = _commit()
        row = generate_row(args.variant, args.tokens, args.reference)
        row["commit"] = commit
        if args.note:
            row["note"] = args.note
        _store("generate", f"{row['model']}@{row['context']} {row['layout']}", row)
    print(section(_load()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
