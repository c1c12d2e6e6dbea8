"""The full-size Gemma-4-E2B export, measured end to end from the command users type.

Builds (once, cached) a checkpoint in the published multimodal layout: `model_type` `gemma4` with `text_config`
(Gemma-4-E2B's, all 35 layers: benchmarks/e2b_width.py), vision and audio towers at transformers' default sizes
(present, and skipped by the exporter), text weights under `model.language_model.*`, random bf16 values, written
in 5 safetensors shards with an index. Then runs `optimum-cli export qnn --model DIR --output OUT --soc SM8650
--quant 16a4w_block -v` (no memory flags) in a child process under `/usr/bin/time -v`, and prints the exporter's
stage lines, its choice of shards, the process's peak RSS, the wall time, and the .pte's size by component
(`python -m optimum_qnn inspect`).

Run it alone: it needs most of the machine's memory, and anything beside it changes both figures.

`--model e4b` does the same for Gemma-4-E4B (benchmarks/e2b_width.e4b_config, rows in e4b_full.json). A run that
fails (killed for memory: exit -9) is stored too, with the stages it finished, beside the exporter's estimate.

Usage: python benchmarks/e2b_full.py [--model e2b|e4b] [--work DIR] [--soc SM8650] [--quant 16a4w_block]
       [--memory-limit GB] [-- extra export flags]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import e2b_width  # noqa: E402
from cpu_meter import STAGE_LINE, CpuMeter  # noqa: E402

CACHE = Path(os.environ.get("OPTIMUM_QNN_CACHE", Path.home() / ".cache" / "optimum-qnn"))
RECIPE_VERSION = 1
SHARDS = 5


# --model: the text config, the cached checkpoint's folder name, the rows file.
MODELS = {"e2b": (e2b_width.e2b_config, "e2b-full", "e2b_full.json"),
          "e4b": (e2b_width.e4b_config, "e4b-full", "e4b_full.json")}


def published_config(model: str = "e2b"):
    from transformers import Gemma4Config
    from transformers.models.gemma4 import configuration_gemma4 as configs

    text = MODELS[model][0]()
    config = Gemma4Config(
        text_config=text.to_dict(), vision_config=configs.Gemma4VisionConfig().to_dict(),
        audio_config=configs.Gemma4AudioConfig().to_dict(), tie_word_embeddings=True,
    )
    config.architectures = ["Gemma4ForConditionalGeneration"]
    config.dtype = "bfloat16"
    return config


def build(folder: Path, seed: int = 0, model: str = "e2b") -> Path:
    """Write the checkpoint of `model` (e2b or e4b) to `folder` unless the same recipe is there already."""
    from safetensors.torch import save_file
    from transformers import Gemma4ForConditionalGeneration

    folder = Path(folder)
    stamp = folder / "recipe.json"
    recipe = {"version": RECIPE_VERSION, "seed": seed, "shards": SHARDS, **({"model": model} if model != "e2b" else {})}
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = published_config(model)
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


PROFILE_RATE = 20  # py-spy samples per second (benchmarks/lowering_profile.py reads the profile)


def run_export(model: Path, out: Path, soc: str | Sequence[str], quant: str | Sequence[str], extra: list[str],
               memory_limit_gb: float | None = None, profile: Path | None = None, allow_failure: bool = False) -> dict:
    """`optimum-cli export qnn` for ``soc`` and ``quant`` (one, or several in one export) under `/usr/bin/time -v`: its stage
    lines, wall time, peak RSS, CPU share and the (first) .pte's components. The log goes beside ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    cli = Path(sys.executable).with_name("optimum-cli")
    socs = [soc] if isinstance(soc, str) else list(soc)
    schemes = [quant] if isinstance(quant, str) else list(quant)
    command = ["/usr/bin/time", "-v", str(cli), "export", "qnn", "--model", str(model), "--output", str(out),
               "--soc", *socs, "--quant", *schemes, "-v", *extra]
    print("$", " ".join(command[2:]), flush=True)
    if profile is not None:  # every process of the export sampled, the forked shard compiles included
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).is_file():
            raise SystemExit("--profile needs py-spy: pip install py-spy")
        # py-spy outside /usr/bin/time: time's figures stay the export's own (inside, they would be py-spy's).
        command = [spy, "record", "--format", "raw", "--subprocesses", "--rate", str(PROFILE_RATE),
                   "--output", str(profile), "--", *command]
    group = MemoryCgroup(memory_limit_gb) if memory_limit_gb else None
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=group.enter if group else None)
        meter = CpuMeter(proc)
        group_peak = group.peak_gb() if group else None
    finally:
        if group:
            group.remove()
    wall = time.perf_counter() - t0
    log = meter.stdout + meter.stderr
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.log").write_text(log)
    # each stderr line with its time and the tree's CPU seconds then, e.g. when the compile gate waited (with -v)
    (out.parent / f"{out.name}.stamped.log").write_text("".join(f"{s:7.1f} s {c:7.1f} CPU s  {text}" for s, c, text in meter.lines))
    result = parse_export(log, out, wall, proc.returncode)
    result["stage_cpu_percent"] = meter.stage_cpu_percent(result["stages"])
    result["lowering_steps"] = meter.lowering_steps()
    if group:
        result["memory_limit_gb"] = memory_limit_gb
        result["cgroup_peak_gb"] = group_peak  # the cgroup's own high-water mark: RSS plus the page cache it was charged
    if proc.returncode:
        print(f"export failed ({proc.returncode}); log: {out.parent / (out.name + '.log')}\n{log[-3000:]}", flush=True)
        if not allow_failure:
            raise SystemExit(1)
    return result


def parse_export(log: str, out: Path, wall: float | None, returncode: int = 0) -> dict:
    """What an export's log (under `/usr/bin/time -v`) and its artifact folder show: the stage lines, wall time
    (``wall``, or else time's elapsed), peak RSS, CPU share and the (first) .pte's components."""
    found = list(STAGE_LINE.finditer(log))
    memory = next((line for line in log.splitlines() if "Memory:" in line), "")
    if wall is None:
        elapsed = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", log)
        wall = sum(float(part) * 60 ** i for i, part in enumerate(reversed(elapsed.group(1).split(":"))))
    result = {"stages": [(m["name"], float(m["s"]), int(m["mb"]) / 1024) for m in found],
              "anonymous_gb": {m["name"]: int(m["anon"]) / 1024 for m in found if m["anon"]}, "wall_s": wall,
              "memory_line": memory.split("Memory:", 1)[-1].strip()}
    if returncode:
        # What a failed run shows: where it stopped (the stages it finished) and how (-9 / 137: killed for memory).
        return {"failed": returncode, **result, "log_tail": log[-1500:]}
    pte = next(out.rglob("model.pte"))
    # /usr/bin/time's figures; under py-spy (--profile) its report can be missing from the log: None then.
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
    cpu = re.search(r"Percent of CPU this job got: (\d+)%", log)
    result.update(
        max_rss_gb=int(rss.group(1)) / 2**20 if rss else None, cpu_percent=int(cpu.group(1)) if cpu else None,
        pte=str(pte), pte_gb=pte.stat().st_size / 2**30, components=components(pte),
    )
    return result


class MemoryCgroup:
    """A memory cgroup of `limit_gb` under this process's own, for the export to run in: a machine of that size as
    far as the kernel's limit goes (the exporter reads the limit and sizes its budget from it). Needs a writable
    cgroup hierarchy (root, v1 or v2)."""

    def __init__(self, limit_gb: float):
        membership = Path("/proc/self/cgroup").read_text().splitlines()
        v1 = next((line.split(":", 2)[2] for line in membership if "memory" in line.split(":")[1].split(",")), None)
        if v1 is not None:
            parent, self.files = Path("/sys/fs/cgroup/memory") / v1.lstrip("/"), ("memory.limit_in_bytes", "memory.max_usage_in_bytes")
        else:
            v2 = next(line.split(":", 2)[2] for line in membership if line.startswith("0::"))
            parent, self.files = Path("/sys/fs/cgroup") / v2.lstrip("/"), ("memory.max", "memory.peak")
        self.path = parent / f"optimum-qnn-bench-{os.getpid()}"
        try:
            self.path.mkdir()
            (self.path / self.files[0]).write_text(str(int(limit_gb * 2**30)))
        except OSError as e:
            raise SystemExit(f"--memory-limit needs a writable memory cgroup ({self.path}): {e}") from None

    def enter(self) -> None:  # in the child, before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_gb(self) -> float | None:
        try:
            return int((self.path / self.files[1]).read_text()) / 2**30
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def components(pte: Path) -> dict[str, float]:
    """The .pte's bytes (GiB) by component, read from the file: the HTP context binaries (quantized weights, their
    scales, the graphs), the CPU embedding tables' integer values and their scales (and zero points), and the rest
    (the program, small constants, alignment)."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.exir.schema import ScalarType, Tensor

    from optimum_qnn.artifacts.inspection import inspect_pte

    htp = sum(context.size for context in inspect_pte(pte).contexts)
    program = deserialize_pte_binary(pte.read_bytes()).program
    element = {ScalarType.BYTE: 1, ScalarType.CHAR: 1, ScalarType.HALF: 2, ScalarType.FLOAT: 4}
    constants: dict[int, tuple[ScalarType, int]] = {}  # by buffer: the methods share their constants
    for plan in program.execution_plan:
        for value in plan.values:
            tensor = value.val
            if isinstance(tensor, Tensor) and tensor.data_buffer_idx and tensor.scalar_type in element:
                numel = math.prod(tensor.sizes)
                constants[tensor.data_buffer_idx] = (tensor.scalar_type, numel * element[tensor.scalar_type])
    big = [(dtype, size) for dtype, size in constants.values() if size >= 2**20]  # the tables, not norms or the like
    values = sum(size for dtype, size in big if dtype in (ScalarType.BYTE, ScalarType.CHAR))
    scales = sum(size for dtype, size in big if dtype in (ScalarType.HALF, ScalarType.FLOAT))
    total = pte.stat().st_size
    return {"htp_contexts": htp / 2**30, "table_values": values / 2**30, "table_scales": scales / 2**30,
            "other": (total - htp - values - scales) / 2**30, "cpu_and_program": (total - htp) / 2**30}


TITLES = {"e2b": "Gemma-4-E2B", "e4b": "Gemma-4-E4B"}


def rows_path(model: str) -> Path:
    """benchmarks/e2b_full.json or e4b_full.json: the stored runs of ``model``."""
    return Path(__file__).parent / MODELS[model][2]


def section(model: str = "e2b") -> str:
    """The RESULTS.md section of the full-size runs of ``model`` stored in its rows file (empty when there are none)."""
    rows_file = rows_path(model)
    if not rows_file.is_file():
        return ""
    stored = json.loads(rows_file.read_text())
    runs = stored["runs"]
    names = list(dict.fromkeys(name for run in runs.values() for name, _, _ in run["stages"]))
    if "plan" in names and "calibrate" in names:  # the recipe's plan stage runs just before calibration
        names.remove("plan")
        names.insert(names.index("calibrate"), "plan")

    def label(key: str, run: dict) -> str:
        if "label" in run:
            return run["label"]
        quant, _, key = key.rpartition(":")
        shards, _, limit = key.partition("@")
        where = f" in a {limit} memory cgroup" if limit else ""
        where += f", --quant {quant}" if quant else ""
        if shards.isdigit():
            return f"--shards {shards}{where}"
        chosen = re.match(r"(\d+) shard", run["memory_line"])
        return f"no memory flags{where} ({chosen.group(1) if chosen else '?'} shards chosen)"

    def cell(run: dict, name: str) -> str:
        """wall s / peak GB, then (rows that have them) the anonymous part and memory.py's estimate before the run."""
        found = [f"{s:.0f} / {gb:.1f}" for stage, s, gb in run["stages"] if stage == name]
        if not found:
            return "-"
        anon = run.get("anonymous_gb", {}).get(name)
        estimate = (run.get("estimate") or {}).get(name.split()[0])
        extra = ([f"anon {anon:.1f}"] if anon is not None else []) + ([f"est {estimate:.1f}"] if estimate else [])
        return found[0] + (f" ({', '.join(extra)})" if extra else "")

    header = ["stage"] + [f"{label(key, run)}: wall s / peak GB" for key, run in runs.items()]
    rows = [[name] + [cell(r, name) for r in runs.values()] for name in names]
    rows.append(["**total** (wall, process max RSS)"] + [
        f"{r['wall_s']:.0f} / {r['max_rss_gb']:.1f}" if "max_rss_gb" in r else f"failed (exit {r['failed']})"
        for r in runs.values()])
    rows.append(["cgroup peak GB (RSS + page cache charged)"] + [
        f"{r['cgroup_peak_gb']:.1f}" if r.get("cgroup_peak_gb") else "-" for r in runs.values()])
    rows.append([".pte GiB (HTP contexts + CPU tables and program)"] + [
        f"{r['pte_gb']:.2f} ({r['components']['htp_contexts']:.2f} + {r['components']['cpu_and_program']:.2f})"
        if "components" in r else "-" for r in runs.values()])
    parts = ("htp_contexts", "table_values", "table_scales", "other")
    rows.append([".pte parts GiB: HTP contexts / table values / table scales / other"] + [
        " / ".join(f"{r['components'][p]:.2f}" for p in parts) if "table_values" in r.get("components", {}) else "-"
        for r in runs.values()])
    rows.append(["commit measured on"] + [r.get("commit", "not recorded") for r in runs.values()])
    table = "\n".join("| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *rows])
    table += cpu_tables(runs, names, label)
    return (
        f"## Full-size {TITLES[model]}, from the command users type\n\n"
        f"Measured (benchmarks/e2b_full.py) on {stored['machine']}: the published multimodal layout (`model_type` "
        "gemma4 with `text_config`, text weights under `model.language_model.*`, vision and audio towers present and "
        "skipped, random bf16 weights, 5 safetensors shards with an index), `optimum-cli export qnn --model DIR "
        "--output OUT --soc SM8650 --quant 16a4w_block (or as named) [--max-seq-len 1024 --prefill-ar-len 128 --shards N --max-memory 23]` "
        "(the bracketed flags only in the --shards columns; 1024 and 128 are the defaults; peak GB: "
        "the stage's highest RSS sampled every 50 ms, including the shard compile workers' private memory; anon: the "
        "highest anonymous part of it (RSS less file-backed pages), est: memory.py's estimate before the run, where "
        "a row has them; the total row's RSS is `/usr/bin/time`'s, the largest single process). One export at a "
        "time, nothing else running.\n\n"
        + table + "\n\n" + stored.get("notes", "") + "\n\n"
    )


def cpu_tables(runs: dict, names: list[str], label) -> str:
    """The CPU share of each stage and of each step of the lowering (`CpuMeter`), for the rows that measured them."""
    measured = {key: run for key, run in runs.items() if run.get("stage_cpu_percent")}
    if not measured:
        return ""
    lines = ["", "", "CPU share (CPU seconds of the export's process tree over wall seconds; 200 % = both cores busy), "
             "by stage:", "", "| stage | " + " | ".join(f"{label(k, r)} ({r['commit']})" for k, r in measured.items()) + " |",
             "|---" * (len(measured) + 1) + "|"]
    order = list(dict.fromkeys(name for run in measured.values() for name, _, _ in run["stages"]))  # as they ran
    for name in [*order, *(n for n in names if n not in order)]:
        cells = [f"{r['stage_cpu_percent'][name]:.0f} %" if name in r["stage_cpu_percent"] else "-" for r in measured.values()]
        if any(c != "-" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **whole export** (/usr/bin/time) | " + " | ".join(
        f"{r['cpu_percent']} %" if r.get("cpu_percent") is not None else "-" for r in measured.values()) + " |")
    for key, run in measured.items():
        if run.get("lowering_steps"):
            lines += ["", f"The lowering's steps, {label(key, run)} ({run['commit']}): each from its progress line to the next.",
                      "", "| step | wall s | CPU |", "|---|---|---|"]
            lines += [f"| {text.split(': ', 1)[-1]} | {seconds:.0f} | {share:.0f} % |"
                      for text, seconds, share in run["lowering_steps"] if seconds >= 1]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="e2b",
                        help="Gemma-4-E2B or Gemma-4-E4B at full size (rows in e2b_full.json / e4b_full.json)")
    parser.add_argument("--work", type=Path, default=None, help="default: /tmp/MODEL-full")
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--quant", default="16a4w_block")
    parser.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                        help="run the export in a memory cgroup of this size (a machine of that size; needs root)")
    parser.add_argument("--profile", type=Path, metavar="FILE",
                        help="record a py-spy profile of the export into FILE and store what it attributes in "
                        "benchmarks/lowering_profile.json; the run's own e2b_full.json row is then not stored (the "
                        "sampling is part of what was timed)")
    parser.add_argument("--from-log", action="store_true",
                        help="store the row of the export already run in --work (its out.log and out/), with the wall "
                        "time /usr/bin/time printed, instead of running it again")
    parser.add_argument("extra", nargs="*", help="more export flags (after --)")
    args = parser.parse_args()
    name = MODELS[args.model][1]
    args.work = args.work or Path(f"/tmp/{name}")
    folder = CACHE / "bench-models" / name
    t0 = time.perf_counter()
    build(folder, model=args.model)
    print(f"checkpoint: {folder} ({time.perf_counter() - t0:.0f} s)")
    if args.from_log:
        result = parse_export((args.work / "out.log").read_text(), args.work / "out", None)
    else:
        result = run_export(folder, args.work / "out", args.soc, args.quant, args.extra, args.memory_limit,
                            args.profile, allow_failure=args.profile is None)
    result["estimate"] = estimate_stages(args.model, args.quant, result["memory_line"])
    if "failed" in result:
        store(rows_path(args.model), row_key(args), result)
        return 1
    cpu = result.get("stage_cpu_percent", {})
    rows = ["| stage | wall s | CPU % | peak RSS GB |", "|---|---|---|---|"]
    rows += [f"| {name} | {s:.0f} | {cpu[name]:.0f} | {gb:.1f} |" if name in cpu else f"| {name} | {s:.0f} | - | {gb:.1f} |"
             for name, s, gb in result["stages"]]
    rss = "-" if result["max_rss_gb"] is None else f"{result['max_rss_gb']:.1f}"
    total_cpu = "-" if result["cpu_percent"] is None else result["cpu_percent"]
    rows.append(f"| **total** (process, /usr/bin/time) | {result['wall_s']:.0f} | {total_cpu} | {rss} |")
    if result.get("lowering_steps"):
        rows += ["", "| lowering step (to the next line) | wall s | CPU % |", "|---|---|---|"]
        rows += [f"| {text} | {s:.0f} | {share:.0f} |" for text, s, share in result["lowering_steps"]]
    print(f"\nMachine: {os.cpu_count()} cores, {mem_total_gb():.1f} GB RAM. Exporter: {result['memory_line']}")
    print("\n".join(rows))
    print(f"\n.pte: {result['pte_gb']:.2f} GiB ({result['pte']})")
    print(subprocess.run([sys.executable, "-m", "optimum_qnn", "inspect", result["pte"]], capture_output=True, text=True).stdout)
    (args.work / "result.json").write_text(json.dumps(result, indent=1))
    if args.profile is not None:  # the profile's rows, not the run's: the sampling is part of what was timed
        import lowering_profile
        from stored import source_commit  # noqa: E402  (benchmarks/ is on sys.path when this runs as a script)

        counts = lowering_profile.read(args.profile)
        print(lowering_profile.table(counts, PROFILE_RATE, 30))
        lowering_profile.store(counts, PROFILE_RATE, label=f"{args.soc} {args.quant} {' '.join(args.extra)}".strip(),
                               commit=source_commit(), wall_s=result["wall_s"], cpu_percent=result["cpu_percent"],
                               stages=result["stages"])
        return 0
    store(rows_path(args.model), row_key(args), result)
    return 0


def row_key(args) -> str:
    """The row's key: the shard count given (or auto), @ the memory cgroup's size, prefixed by a scheme other than
    16a4w_block."""
    shards = next((args.extra[i + 1] for i, a in enumerate(args.extra[:-1]) if a == "--shards"), "auto")
    if args.memory_limit:
        shards += f"@{args.memory_limit:g}GB"
    if args.quant != "16a4w_block":
        shards = f"{args.quant}:{shards}"
    return shards


def store(rows_file: Path, key: str, result: dict) -> None:
    from stored import source_commit  # noqa: E402  (benchmarks/ is on sys.path when this runs as a script)

    stored = json.loads(rows_file.read_text()) if rows_file.is_file() else {"runs": {}}
    stored["machine"] = f"{os.cpu_count()} cores, {mem_total_gb():.1f} GB RAM"
    stored["runs"][key] = {**{k: v for k, v in result.items() if k != "pte"}, "commit": source_commit()}
    rows_file.write_text(json.dumps(stored, indent=1))


def estimate_stages(model: str, quant: str, memory_line: str) -> dict[str, float] | None:
    """The exporter's own per-stage estimate (optimum_qnn.exporter.memory) at the shard count it printed, as it
    stood before the run: what the run's measurement is held against."""
    from optimum_qnn.config import RECIPES, ExportConfig, QuantScheme, recipe_fields
    from optimum_qnn.exporter.memory import estimate
    from optimum_qnn.exporter.parameters import ParameterCounts

    chosen = re.match(r"(\d+) shard", memory_line)
    if not chosen:
        return None
    counts = ParameterCounts.from_config(MODELS[model][0]())
    config = ExportConfig(**recipe_fields(quant)) if quant in RECIPES else ExportConfig(quant=QuantScheme(quant))
    return estimate(counts, config, int(chosen.group(1))).stages


def mem_total_gb() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20


if __name__ == "__main__":
    raise SystemExit(main())
