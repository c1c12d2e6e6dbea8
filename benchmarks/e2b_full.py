"""The full-size Gemma-4-E2B export, measured end to end from the command users type.

Builds (once, cached) a checkpoint in the published multimodal layout: `model_type` `gemma4` with `text_config`
(Gemma-4-E2B's, all 35 layers: benchmarks/e2b_width.py), vision and audio towers at transformers' default sizes
(present, and skipped by the exporter), text weights under `model.language_model.*`, random bf16 values, written
in 5 safetensors shards with an index. Then runs `optimum-cli export qnn --model DIR --output OUT --soc SM8650
--quant 16a4w_block -v` (no memory flags) in a child process under `/usr/bin/time -v`, and prints the exporter's
stage lines, its choice of shards, the process's peak RSS, the wall time, and the .pte's size by component
(`python -m optimum_qnn inspect`).

Run it alone: it needs most of the machine's memory, and anything beside it changes both figures.

Usage: python benchmarks/e2b_full.py [--work DIR] [--soc SM8650] [--quant 16a4w_block] [-- extra export flags]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import e2b_width  # noqa: E402

CACHE = Path(os.environ.get("OPTIMUM_QNN_CACHE", Path.home() / ".cache" / "optimum-qnn"))
RECIPE_VERSION = 1
SHARDS = 5


def published_config():
    from transformers import Gemma4Config
    from transformers.models.gemma4 import configuration_gemma4 as configs

    text = e2b_width.e2b_config()
    config = Gemma4Config(
        text_config=text.to_dict(), vision_config=configs.Gemma4VisionConfig().to_dict(),
        audio_config=configs.Gemma4AudioConfig().to_dict(), tie_word_embeddings=True,
    )
    config.architectures = ["Gemma4ForConditionalGeneration"]
    config.dtype = "bfloat16"
    return config


def build(folder: Path, seed: int = 0) -> Path:
    """Write the checkpoint to `folder` unless the same recipe is there already."""
    from safetensors.torch import save_file
    from transformers import Gemma4ForConditionalGeneration

    folder = Path(folder)
    stamp = folder / "recipe.json"
    recipe = {"version": RECIPE_VERSION, "seed": seed, "shards": SHARDS}
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = published_config()
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Gemma4ForConditionalGeneration(config).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied to the token table
    total = sum(torch.Size(s).numel() for s in shapes.values()) * 2
    gen = torch.Generator().manual_seed(seed)
    index, shard, size, written = {}, {}, 0, 0
    names = list(shapes)
    limit = total // SHARDS + 1

    def flush(number: int) -> None:
        nonlocal shard, size
        name = f"model-{number:05d}-of-{SHARDS:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shard, size = {}, 0

    number = 1
    t0 = time.perf_counter()
    for key in names:
        t = shard[key] = e2b_width.random_weight(shapes[key], gen)
        size += t.nbytes
        written += t.nbytes
        if size >= limit and number < SHARDS:
            flush(number)
            number += 1
            print(f"  {written / 2**30:.1f} / {total / 2**30:.1f} GiB written ({time.perf_counter() - t0:.0f} s)", flush=True)
    flush(number)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": written}, "weight_map": index}, indent=1))
    config.save_pretrained(folder)
    stamp.write_text(json.dumps(recipe))
    return folder


_STAGE = re.compile(r"\[(?P<name>[\w ]+)\] done in (?P<s>[\d.]+) s, peak RSS (?P<mb>\d+) MB")


def run_export(model: Path, out: Path, soc: str, quant: str, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cli = Path(sys.executable).with_name("optimum-cli")
    command = ["/usr/bin/time", "-v", str(cli), "export", "qnn", "--model", str(model), "--output", str(out),
               "--soc", soc, "--quant", quant, "-v", *extra]
    print("$", " ".join(command[2:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    (out.parent / f"{out.name}.log").write_text(log)
    if proc.returncode:
        raise SystemExit(f"export failed ({proc.returncode}); log: {out.parent / (out.name + '.log')}\n{log[-3000:]}")
    stages = [(m["name"], float(m["s"]), int(m["mb"]) / 1024) for m in _STAGE.finditer(log)]
    max_rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1)) / 2**20
    memory = next((line for line in log.splitlines() if "Memory:" in line), "")
    pte = next(out.rglob("model.pte"))
    return {"stages": stages, "wall_s": wall, "max_rss_gb": max_rss, "memory_line": memory.split("Memory:", 1)[-1].strip(),
            "pte": str(pte), "pte_gb": pte.stat().st_size / 2**30, "components": components(pte)}


def components(pte: Path) -> dict[str, float]:
    """The .pte's bytes (GiB) by component: the HTP context binaries (quantized weights, their scales, the graphs)
    and everything else (the CPU embedding tables with their scales and zero points, the program)."""
    from optimum_qnn.inspection import inspect_pte

    htp = sum(context.size for context in inspect_pte(pte).contexts)
    return {"htp_contexts": htp / 2**30, "cpu_and_program": (pte.stat().st_size - htp) / 2**30}


RESULTS_FILE = Path(__file__).parent / "e2b_full.json"


def section() -> str:
    """The RESULTS.md section of the full-size runs stored in `RESULTS_FILE` (empty when there are none)."""
    if not RESULTS_FILE.is_file():
        return ""
    stored = json.loads(RESULTS_FILE.read_text())
    runs = stored["runs"]
    names = [name for name, _, _ in next(iter(runs.values()))["stages"]]
    def label(key: str, run: dict) -> str:
        if key.isdigit():
            return f"--shards {key}"
        chosen = re.match(r"(\d+) shard", run["memory_line"])
        return f"no --shards ({chosen.group(1) if chosen else '?'} chosen)"

    header = ["stage"] + [f"{label(key, run)}: wall s / peak GB" for key, run in runs.items()]
    rows = [[name] + [f"{r['stages'][i][1]:.0f} / {r['stages'][i][2]:.1f}" for r in runs.values()] for i, name in enumerate(names)]
    rows.append(["**total** (wall, process max RSS)"] + [f"{r['wall_s']:.0f} / {r['max_rss_gb']:.1f}" for r in runs.values()])
    rows.append([".pte GiB (HTP contexts + CPU tables and program)"] + [
        f"{r['pte_gb']:.2f} ({r['components']['htp_contexts']:.2f} + {r['components']['cpu_and_program']:.2f})"
        for r in runs.values()])
    table = "\n".join("| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *rows])
    return (
        "## Full-size Gemma-4-E2B, from the command users type\n\n"
        f"Measured (benchmarks/e2b_full.py) on {stored['machine']}: the published multimodal layout (`model_type` "
        "gemma4 with `text_config`, text weights under `model.language_model.*`, vision and audio towers present and "
        "skipped, random bf16 weights, 5 safetensors shards with an index), `optimum-cli export qnn --model DIR "
        "--output OUT --soc SM8650 --quant 16a4w_block [--max-seq-len 1024 --prefill-ar-len 128 --shards N --max-memory 23]` "
        "(the bracketed flags only in the --shards columns; 1024 and 128 are the defaults; peak GB: "
        "the stage's highest RSS sampled every 50 ms, including the shard compile workers' private memory; the total "
        "row's RSS is `/usr/bin/time`'s, the largest single process). One export at a time, nothing else running.\n\n"
        + table + "\n\n" + stored.get("notes", "") + "\n\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/e2b-full"))
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--quant", default="16a4w_block")
    parser.add_argument("extra", nargs="*", help="more export flags (after --)")
    args = parser.parse_args()
    folder = CACHE / "bench-models" / "e2b-full"
    t0 = time.perf_counter()
    build(folder)
    print(f"checkpoint: {folder} ({time.perf_counter() - t0:.0f} s)")
    result = run_export(folder, args.work / "out", args.soc, args.quant, args.extra)
    rows = ["| stage | wall s | peak RSS GB |", "|---|---|---|"]
    rows += [f"| {name} | {s:.0f} | {gb:.1f} |" for name, s, gb in result["stages"]]
    rows.append(f"| **total** (process, /usr/bin/time) | {result['wall_s']:.0f} | {result['max_rss_gb']:.1f} |")
    print(f"\nMachine: {os.cpu_count()} cores, {mem_total_gb():.1f} GB RAM. Exporter: {result['memory_line']}")
    print("\n".join(rows))
    print(f"\n.pte: {result['pte_gb']:.2f} GiB ({result['pte']})")
    print(subprocess.run([sys.executable, "-m", "optimum_qnn", "inspect", result["pte"]], capture_output=True, text=True).stdout)
    (args.work / "result.json").write_text(json.dumps(result, indent=1))
    shards = next((args.extra[i + 1] for i, a in enumerate(args.extra[:-1]) if a == "--shards"), "auto")
    stored = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.is_file() else {"runs": {}}
    stored["machine"] = f"{os.cpu_count()} cores, {mem_total_gb():.1f} GB RAM"
    stored["runs"][shards] = {k: v for k, v in result.items() if k != "pte"}
    RESULTS_FILE.write_text(json.dumps(stored, indent=1))
    return 0


def mem_total_gb() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20


if __name__ == "__main__":
    raise SystemExit(main())
