"""Where an export's CPU time goes, by stage and by ExecuTorch/QNN pass, from a py-spy profile of the export.

`benchmarks/e2b_full.py --profile FILE` records one (`py-spy record --format raw --subprocesses`: every sample of
every process of the export, the forked shard compiles included, idle threads left out). This script reads the
collapsed stacks and attributes each sample to

- the process: the export's own (``main``), a forked shard compile (``worker``) or a method converted to the edge
  dialect in its own process (``edge child``);
- the exporter's stage: the outermost optimum_qnn function of a known stage (load, calibrate, lower, ...);
- the step inside it: the outermost frame that is an ExecuTorch or QNN pass, partitioner, op builder or serializer
  (by file: ``_passes/``, ``exir/passes/``, ``partitioner``, ``builders/``, ``_emit``, ``serialize``...), else the
  outermost ExecuTorch / torch function, else the stage itself.

Seconds are samples / rate (CPU seconds of the sampled processes, not wall time). Prints a table; `--json` stores it.

Usage: python benchmarks/lowering_profile.py PROFILE [--rate 20] [--top 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# optimum_qnn functions that mark a stage, outermost first wins.
STAGES = {
    "resolve_model_folder": "load", "preflight": "load", "load_text_model": "load", "from_hf": "swap",
    "_quantize": "quantize", "_evaluator": "evaluate", "lower_to_pte": "lower", "EdgeLowering.prepare": "edge",
    "EdgeLowering.lower": "lower", "_convert_and_dump": "edge", "export_time_inspection": "inspect",
    "write_variant": "write", "_compile_and_exit": "shard compile", "StaticCausalLM.export": "export",
    "swap_embeddings_for_cpu": "swap", "upcast_in_graph": "swap", "write_model_card": "write",
    "release_float_weights": "map", "map_weights_to_file": "map",
}
STEP_FILES = ("/_passes/", "/exir/passes/", "partition", "/builders/", "qnn_preprocess", "/exir/emit/", "serialize",
              "/exir/verification/", "memory_planning", "decomp", "/torch/_export/", "backend_api", "lowered_backend_module",
              "/torch/export/", "parallel_compile", "/torchao/")
# Steps that only dispatch to others: their samples are split by the step below them.
WRAPPERS = ("backend_api.", "exported_program.", "_program.", "qnn_pass_manager.", "pass_base.", "pass_manager.")
# A sample whose innermost frame is one of these waits: py-spy does not always see such a thread as idle.
WAITS = {"wait", "select", "sleep", "poll", "acquire", "_wait_for_tstate_lock", "join", "waitpid", "read"}
# Threads at nice 19 (the checkpoint's SHA-256 in the background, `writer.BackgroundDigests`): py-spy samples a thread
# that is ready to run as busy, and one at nice 19 is ready and waiting for a core most of the time. Sampled over a
# full-size Gemma-4-E2B export it came to 442 "CPU s" (9ebceaa), where hashing its 9.5 GB takes about 10 (1.1 CPU s
# per GiB, measured on this machine): its samples are counted as waiting.
LOW_PRIORITY = ("BackgroundDigests._hash",)


def parse_frame(text: str) -> tuple[str, str]:
    m = _FRAME.match(text.strip())
    return (m["func"], m["file"]) if m else (text.strip(), "")


def attribute(stack: list[str]) -> tuple[str, str, str]:
    """(process, stage, step) of one sample's stack, outermost frame first."""
    frames = [parse_frame(f) for f in stack]
    if frames and frames[-1][0].rpartition(".")[2] in WAITS:
        return "idle", "waiting", frames[-1][0]
    low = next((func for func, _ in frames if func in LOW_PRIORITY), None)
    if low is not None:
        return "idle", "low priority", low
    process = "main"
    if frames and frames[0][0].startswith("process "):
        functions = ";".join(f for f, _ in frames)
        if "_compile_and_exit" in functions:
            process = "worker"
        elif "_convert_and_dump" in functions:  # a method converted to the edge dialect in its own process
            process = "edge child"
    stage, start = "other", 0
    for i, (func, file) in enumerate(frames):
        name = func if func in STAGES else func.rpartition(".")[2]  # py-spy names methods Class.method
        if "optimum_qnn" in file and name in STAGES:
            stage, start = STAGES[name], i + 1
            break
    # The outermost step, and inside a wrapper (to_backend, a pass manager, the decompositions) the next one down.
    matched = [f"{Path(file).stem}.{func}" for func, file in frames[start:]
               if any(key in "/" + file for key in STEP_FILES)]  # py-spy writes paths from the package on
    step = ""
    if matched:
        outer = matched[0]
        inner = next((m for m in matched[1:] if m.split(".")[0] != outer.split(".")[0]), None)
        step = outer if inner is None or not any(w in outer for w in WRAPPERS) else f"{outer} > {inner}"
    if not step:
        outside = next(((func, file) for func, file in frames[start:] if "optimum_qnn" not in file and file), None)
        step = f"{Path(outside[1]).stem}.{outside[0]}" if outside else "(own code)"
    return process, stage, step


def read(path: Path) -> Counter:
    counts: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        counts[attribute(stack.split(";"))] += int(n)
    return counts


def table(counts: Counter, rate: float, top: int) -> str:
    idle = sum(n for (p, _, _), n in counts.items() if p == "idle")
    counts = Counter({k: n for k, n in counts.items() if k[0] != "idle"})
    total = sum(counts.values())
    by_stage: Counter = Counter()
    for (process, stage, _), n in counts.items():
        by_stage[process, stage] += n
    lines = [f"{total / rate:.0f} CPU s sampled at {rate:g} Hz (and {idle / rate:.0f} s of threads waiting, left out)", "", "| process | stage | CPU s | share |", "|---|---|---|---|"]
    lines += [f"| {p} | {s} | {n / rate:.0f} | {100 * n / total:.1f}% |" for (p, s), n in by_stage.most_common()]
    lines += ["", "| process | stage | step | CPU s | share |", "|---|---|---|---|---|"]
    lines += [f"| {p} | {s} | `{step}` | {n / rate:.0f} | {100 * n / total:.1f}% |"
              for (p, s, step), n in counts.most_common(top)]
    return "\n".join(lines)


ROWS_FILE = Path(__file__).parent / "lowering_profile.json"


def store(counts: Counter, rate: float, *, label: str, commit: str, wall_s: float, cpu_percent: int | None,
          stages: list) -> dict:
    """Keep one profiled export's rows in benchmarks/lowering_profile.json under ``label`` (RESULTS.md renders them)."""
    busy = Counter({k: n for k, n in counts.items() if k[0] != "idle"})
    by_stage: Counter = Counter()
    for (process, stage, _), n in busy.items():
        by_stage[process, stage] += n
    row = {
        "commit": commit, "rate_hz": rate, "wall_s": round(wall_s, 1), "cpu_percent": cpu_percent,
        "sampled_cpu_s": round(sum(busy.values()) / rate, 1),
        "stages": [{"name": name, "wall_s": s, "peak_rss_gb": round(gb, 2)} for name, s, gb in stages],
        "by_stage": [{"process": p, "stage": s, "cpu_s": round(n / rate, 1)} for (p, s), n in by_stage.most_common()],
        "steps": [{"process": p, "stage": s, "step": step, "cpu_s": round(n / rate, 1)}
                  for (p, s, step), n in busy.most_common(40)],
    }
    stored = json.loads(ROWS_FILE.read_text()) if ROWS_FILE.is_file() else {"runs": {}}
    stored["runs"][label] = row
    ROWS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--rate", type=float, default=20.0, help="the sampling rate the profile was recorded at")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = read(args.profile)
    print(table(counts, args.rate, args.top))
    if args.json:
        rows = [{"process": p, "stage": s, "step": step, "cpu_s": n / args.rate} for (p, s, step), n in counts.most_common()
                if p != "idle"]
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
