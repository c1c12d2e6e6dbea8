"""onnxruntime-qnn against ExecuTorch's runtime on the same .pte, on the x86 HTP emulator: seconds per call (decode,
prefill), load time and peak RSS, one runtime after the other in one run.

Each runtime runs in its own child process, so neither shares the other's peak RSS (VmHWM of that process) or its
loaded libraries; a last child runs both, one call of each in turn, for per-call times under the same load (the
fairest ratio on a shared host). All get the same inputs (random runner-contract inputs, seed 0) and the table says whether their
outputs were byte-identical. The variant is the demo model exported as `make demo` does (16a8w hybrid, SM8650,
context 128, prefill 16, asymmetric 8-bit tables), built once into --work, or given with --variant.

`--generate N` runs the model instead, as a user does: each runtime in its own child process loads the variant with
`QNNModelForCausalLM.from_pretrained(artifact, device="host:<runtime>")` and generates N tokens greedily from a fixed
prompt of ids (random-weight checkpoints have no tokenizer), reporting load time, time to first token, decode seconds
per token, peak RSS and the tokens, which must be the same through both (the full-size E2B row:
`--variant <unshared E2B variant> --generate 16 --json benchmarks/ort_vs_executorch_e2b.json`).

Usage: python benchmarks/ort_vs_executorch.py [--variant DIR] [--decode-calls 30] [--prefill-calls 8] [--rounds 2]
       [--generate N] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RUNTIMES = ("onnxruntime", "executorch")


def build_demo_variant(work: Path, context: int = 128, block_len: int | None = None) -> Path:
    """The demo model exported like `examples/demo.py`, at ``context`` (reused when --work already holds it); with
    ``block_len``, in the blocks cache layout with blocks of that many slots."""
    found = sorted(work.glob("artifact/qnn/*/*/manifest.json"))
    if found:
        return found[0].parent
    sys.path.insert(0, str(REPO / "examples"))
    import tiny_gemma4

    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.contract import CacheLayout
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.quantization.calibration import CalibrationSource

    # The tests' cached build of the demo model when it is there (training it again takes minutes), else a new one.
    cached = Path.home() / ".cache" / "optimum-qnn" / "test-models" / "demo-gemma4"
    model_dir = cached if tiny_gemma4.is_built(cached) else tiny_gemma4.build(work / "model")
    work.mkdir(parents=True, exist_ok=True)
    calib = work / "calibration.txt"
    calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:64]))
    config = ExportConfig(
        socs=(Soc.SM8650,), quant=QuantScheme.A16W8, mode=ExportMode.HYBRID,
        shapes=ShapeConfig(max_seq_len=context, prefill_ar_len=16, cache_block_len=block_len,
                           cache_layout=None if block_len is None else CacheLayout.BLOCKS), embedding_quant=EmbeddingQuant(8, 0, symmetric=False),
        weight_sharing=False,
    )
    return export(model_dir, work / "artifact", config, calibration=CalibrationSource(file=calib, limit=16)).variants[0]


def _inputs(manifest, method: str):
    import numpy as np

    rng = np.random.default_rng(0)
    spec = next(m for m in manifest.contract.methods if m.name == method)
    out = []
    for t in spec.inputs:
        dtype = np.dtype(t.dtype)
        if t.name == "tokens":
            out.append(rng.integers(0, manifest.contract.vocab_size, t.shape).astype(dtype))
        elif t.name == "input_pos":
            out.append(np.arange(int(np.prod(t.shape))).reshape(t.shape).astype(dtype))
        elif dtype.kind == "f":
            out.append(rng.standard_normal(t.shape).astype(dtype))
        else:
            out.append(rng.integers(0, np.iinfo(dtype).max, t.shape, endpoint=True).astype(dtype))
    return out


def child(runtime: str, variant: Path, calls: dict[str, int]) -> dict:
    """Load `variant` in `runtime`, time its methods; runs in a fresh process."""
    from optimum_qnn.artifacts.manifest import read_manifest

    manifest = read_manifest(variant)
    t0 = time.perf_counter()
    if runtime == "onnxruntime":
        from optimum_qnn.runtime.backends.onnxruntime import OrtProgram

        program = OrtProgram(variant / "model.pte", manifest)
        run = {name: program.methods[name] for name in calls}
        convert = lambda xs: xs  # noqa: E731
        to_numpy = lambda outs: outs  # noqa: E731
    else:
        import torch

        from optimum_qnn.program import LoadedProgram, ProgramFacts

        loaded = LoadedProgram.get(variant / "model.pte", ProgramFacts.of(manifest))
        run = {name: loaded.methods[name].execute for name in calls}
        convert = lambda xs: [torch.from_numpy(x) for x in xs]  # noqa: E731
        to_numpy = lambda outs: [o.numpy() for o in outs]  # noqa: E731
    load_s = time.perf_counter() - t0
    result: dict = {"runtime": runtime, "load_s": load_s, "methods": {}}
    for name, n in calls.items():
        args = convert(_inputs(manifest, name))
        digest = hashlib.sha256(b"".join(o.tobytes() for o in to_numpy(run[name](args)))).hexdigest()  # warm-up
        times = []
        for _ in range(n):
            t = time.perf_counter()
            run[name](args)
            times.append(time.perf_counter() - t)
        result["methods"][name] = {"median_s": statistics.median(times), "mean_s": statistics.fmean(times),
                                   "min_s": min(times), "calls": n, "sha256": digest}
    with open("/proc/self/status") as f:
        result["peak_rss_mb"] = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    return result


PROMPT_LEN = 8


def generate_child(runtime: str, variant: Path, tokens: int) -> dict:
    """Load ``variant`` as a user does through ``runtime`` and generate ``tokens`` greedily; runs in a fresh process."""
    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    manifest = read_manifest(variant)
    t0 = time.perf_counter()
    model = QNNModelForCausalLM.from_pretrained(  # the artifact folder: <artifact>/qnn/<soc>/<variant>
        variant.parents[2], soc=manifest.target.soc,
        context_len=manifest.contract.context_len, cache_layout=manifest.contract.cache_layout, device=f"host:{runtime}")
    load_s = time.perf_counter() - t0
    import numpy as np

    prompt = np.random.default_rng(0).integers(0, manifest.contract.vocab_size, PROMPT_LEN).tolist()  # fixed, seeded
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=tokens, eos_token_id=[])
    wall_s = time.perf_counter() - t0
    s = model.stats
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    return {"runtime": runtime, "load_s": load_s, "generate_s": wall_s, "ttft_s": s.time_to_first_token_s,
            "decode_s_per_token": statistics.median(s.step_times) if s.step_times else None,
            "decode_calls": len(s.step_times), "prompt_tokens": s.prompt_tokens,
            "tokens": [int(t) for t in out[0][PROMPT_LEN:]], "peak_rss_mb": peak}


def interleaved(variant: Path, calls: dict[str, int]) -> dict:
    """Both runtimes in one process (ExecuTorch loaded first), one call of each in turn: both see the same load,
    which on a shared host moves more between two processes than the runtimes differ."""
    import torch

    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.program import LoadedProgram, ProgramFacts
    from optimum_qnn.runtime.backends.onnxruntime import OrtProgram
    from optimum_qnn.sdk import ensure_qnn_sdk

    ensure_qnn_sdk()
    manifest = read_manifest(variant)
    loaded = LoadedProgram.get(variant / "model.pte", ProgramFacts.of(manifest))
    program = OrtProgram(variant / "model.pte", manifest)
    result = {}
    for name, n in calls.items():
        args = _inputs(manifest, name)
        tensors = [torch.from_numpy(x) for x in args]
        et_call, ort_call = loaded.methods[name].execute, program.methods[name]
        et_call(tensors), ort_call(args)  # warm-up
        et_times, ort_times = [], []
        for _ in range(n):
            t = time.perf_counter()
            et_call(tensors)
            et_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            ort_call(args)
            ort_times.append(time.perf_counter() - t)
        result[name] = {"executorch_s": statistics.median(et_times), "onnxruntime_s": statistics.median(ort_times)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", type=Path, help="a variant folder (manifest.json + model.pte)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/optimum-qnn-bench-ort"), help="where the demo export goes")
    parser.add_argument("--decode-calls", type=int, default=30)
    parser.add_argument("--prefill-calls", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; each runtime keeps its best")
    parser.add_argument("--generate", type=int, metavar="N", help="generate N tokens through each runtime instead")
    parser.add_argument("--note", default="", help="with --generate: what the variant is, stored with the rows")
    parser.add_argument("--child", choices=(*RUNTIMES, "interleaved"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    calls = {"kv_forward": args.decode_calls, "prefill_forward": args.prefill_calls}
    if args.child == "interleaved":
        print(json.dumps(interleaved(args.variant, calls)))
        return
    if args.child and args.generate:
        print(json.dumps(generate_child(args.child, args.variant, args.generate)))
        return
    if args.child:
        print(json.dumps(child(args.child, args.variant, calls)))
        return
    if args.variant is None:
        from optimum_qnn.sdk import ensure_qnn_sdk

        ensure_qnn_sdk()  # the exporter lowers through executorch's Qualcomm code
    variant = args.variant or build_demo_variant(args.work)
    best: dict[str, dict] = {}
    # One after the other, each in its own process, alternating for --rounds rounds: on a shared host the load
    # changes by the minute, so each runtime keeps its fastest round (per method: the round's median call).
    def run_child(mode: str) -> dict:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--variant", str(variant),
             "--decode-calls", str(args.decode_calls), "--prefill-calls", str(args.prefill_calls),
             *(["--generate", str(args.generate)] if args.generate else [])],
            capture_output=True, text=True, cwd=REPO,
        )
        if proc.returncode != 0:
            sys.exit(f"{mode} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    if args.generate:
        generated(variant, [run_child(r) for r in RUNTIMES], args.json, args.note)
        return
    for runtime in [r for _ in range(args.rounds) for r in RUNTIMES]:
        row = run_child(runtime)
        kept = best.setdefault(runtime, row)
        for name, m in row["methods"].items():
            if m["median_s"] < kept["methods"][name]["median_s"]:
                kept["methods"][name] = m
        kept["load_s"] = min(kept["load_s"], row["load_s"])
        kept["peak_rss_mb"] = max(kept["peak_rss_mb"], row["peak_rss_mb"])
    rows = [best[r] for r in RUNTIMES]
    ort, et = rows
    print(f"variant: {variant}")
    print(f"{'':<26}{'onnxruntime':>13}{'executorch':>13}{'ort/et':>9}")
    for name, label in (("kv_forward", "decode s/call (median)"), ("prefill_forward", "prefill s/call (median)")):
        a, b = ort["methods"][name]["median_s"], et["methods"][name]["median_s"]
        print(f"{label:<26}{a:>13.4f}{b:>13.4f}{a / b:>9.2f}")
    print(f"{'load s':<26}{ort['load_s']:>13.2f}{et['load_s']:>13.2f}{ort['load_s'] / et['load_s']:>9.2f}")
    print(f"{'peak RSS MB':<26}{ort['peak_rss_mb']:>13.0f}{et['peak_rss_mb']:>13.0f}"
          f"{ort['peak_rss_mb'] / et['peak_rss_mb']:>9.2f}")
    mixed = run_child("interleaved")
    for name, label in (("kv_forward", "decode, interleaved"), ("prefill_forward", "prefill, interleaved")):
        a, b = mixed[name]["onnxruntime_s"], mixed[name]["executorch_s"]
        print(f"{label:<26}{a:>13.4f}{b:>13.4f}{a / b:>9.2f}")
    same = all(ort["methods"][n]["sha256"] == et["methods"][n]["sha256"] for n in calls)
    print(f"outputs byte-identical: {same}")
    if args.json:
        args.json.write_text(json.dumps({"variant": str(variant), "rows": rows, "interleaved": mixed, "identical": same}, indent=2) + "\n")


def generated(variant: Path, rows: list[dict], out: Path | None, note: str) -> None:
    """The table of a --generate run; the rows go to ``out``."""
    ort, et = rows
    print(f"variant: {variant}")
    print(f"{'':<26}{'onnxruntime':>13}{'executorch':>13}{'ort/et':>9}")
    for key, label in (("load_s", "load s"), ("ttft_s", "first token s"), ("decode_s_per_token", "decode s/token (median)"),
                       ("peak_rss_mb", "peak RSS MB")):
        print(f"{label:<26}{ort[key]:>13.3f}{et[key]:>13.3f}{ort[key] / et[key]:>9.2f}")
    same = ort["tokens"] == et["tokens"]
    print(f"{ort['decode_calls'] + 1} tokens, the same through both: {same}")
    if out:
        out.write_text(json.dumps({"variant": str(variant), "note": note, "generate": rows, "identical": same}, indent=2) + "\n")


if __name__ == "__main__":
    main()
