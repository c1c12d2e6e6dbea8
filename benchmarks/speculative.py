"""Plain, lookahead and assistant decoding of the demo model on the x86 HTP emulator, one after the other in one run.

Three exports of the demo Gemma4 (examples/tiny_gemma4.py) with the same scheme (16a8w with uint16 graph IO, the
default; SM8650, context 128, prefill 16, weights not shared): plain hybrid, `--mode lookahead`
(N 4, W 3, G 3: kv_forward of 32 tokens) and `--assistant` with the demo's distilled drafter
(examples/tiny_gemma4_assistant.py, `--draft-len 3`: kv_forward of 4 tokens plus `draft_forward`). Each is run through
`QNNModelForCausalLM` (host:onnxruntime) on prompts held out from the drafter's training
(`tiny_gemma4_assistant.heldout_ids`), greedy, and checked token for token against plain decoding of its own variant.

Per mode: tokens per target call (new tokens after the prefill's first / decode calls of the target), target calls per
100 tokens, drafter calls, emulator decode seconds and tokens per second. The SM8750 column is an **estimate**: the
per-call cost model of benchmarks/contexts.py (bytes a call reads / 84.8 GB/s) applied to full-size Gemma-4-E2B at its
default context (the 4096 row of contexts.json: weights and caches one decode call reads), each target call at that cost
whatever its token count (a call is bound by its weight reads), plus, for the assistant, each drafter call at the E2B
assistant's weights (about 78 M parameters at 8 bits: 78 MB, an estimate), over the tokens per target call measured
here. It says what the demo's acceptance would buy at E2B's call cost, not what a trained E2B drafter accepts.

Usage: python benchmarks/speculative.py [--work DIR] [--prompts 8] [--new-tokens 48] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

CACHE = Path.home() / ".cache" / "optimum-qnn" / "test-models"
COMMON = ["--soc", "SM8650", "--quant", "16a8w", "--max-seq-len", "128", "--prefill-ar-len", "16",
          "--no-weight-sharing", "--embedding-quant", "8,0,asym", "--calib-limit", "16"]
MODES = {"plain": [], "lookahead": ["--mode", "lookahead", "--ngram", "4", "--window", "3", "--gcap", "3"],
         "assistant": ["--assistant", "{assistant}", "--draft-len", "3"]}
E2B_ASSISTANT_BYTES = 78e6  # about 78 M parameters at 8 bits (estimate)


def models() -> tuple[Path, Path]:
    """The demo model and its assistant, built (and cached) as the tests build them."""
    import tiny_gemma4
    import tiny_gemma4_assistant

    target = CACHE / "demo-gemma4"
    if not tiny_gemma4.is_built(target):
        tiny_gemma4.build(target)
    assistant = CACHE / "demo-gemma4-assistant"
    if not tiny_gemma4_assistant.is_built(target, assistant):
        subprocess.run([sys.executable, str(REPO / "examples" / "tiny_gemma4_assistant.py"), str(target), str(assistant)],
                       check=True)
    return target, assistant


def export(mode: str, target: Path, assistant: Path, work: Path) -> Path:
    """One export with the command users type (reused when ``work`` holds one made with the same flags); returns the
    artifact folder."""
    out = work / mode
    flags = [f.format(assistant=assistant) for f in MODES[mode]]
    stamp = work / f"{mode}.flags.json"
    if list(out.glob("qnn/*/*/manifest.json")) and stamp.is_file() and json.loads(stamp.read_text()) == COMMON + flags:
        return out
    shutil.rmtree(out, ignore_errors=True)
    calib = work / "calibration.txt"
    if not calib.exists():
        import tiny_gemma4

        calib.parent.mkdir(parents=True, exist_ok=True)
        calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:64]))
    cmd = [sys.executable, "-m", "optimum_qnn", "export", "--model", str(target), "--output", str(out),
           "--calib-file", str(calib), *COMMON, *flags]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    print(f"  {mode}: exported in {time.perf_counter() - t0:.0f} s", flush=True)
    stamp.write_text(json.dumps(COMMON + flags))
    return out


def measure(mode: str, folder: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy generation of every prompt, plain and (but for plain) speculative, through host:onnxruntime."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    model = QNNModelForCausalLM.from_pretrained(folder, device="host:onnxruntime")
    speculative = None if mode == "plain" else mode
    row = {"mode": mode, "tokens": 0, "target_calls": 0, "drafter_calls": 0, "decode_s": 0.0, "identical": True}
    for prompt in prompts:
        plain = model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=[]).tolist()
        out = model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=[], speculative=speculative).tolist()
        row["identical"] &= out == plain
        s = model.stats
        row["tokens"] += s.decode_tokens
        row["target_calls"] += s.target_calls
        row["drafter_calls"] += getattr(s, "drafter_calls", 0)
        row["decode_s"] += sum(s.step_times)
    row["tokens_per_target_call"] = row["tokens"] / row["target_calls"]
    row["decode_tokens_per_s"] = row["tokens"] / row["decode_s"]
    return row


def sm8750_ms_per_token(row: dict, draft_len: int = 3) -> float:
    """The estimate the module's docstring describes, in ms per token."""
    import contexts

    e2b = json.loads((REPO / "benchmarks" / "contexts.json").read_text())["exports"]["e2b@default"]
    decode = e2b["calls"]["kv_forward"]
    weights = next(v for k, v in e2b["graphs"].items() if k.startswith("kv_forward")).get("weights", 0)
    target_ms = contexts.estimate_ms(decode["kv_in"] + decode["out"]) + contexts.estimate_ms(weights)
    drafter_ms = contexts.estimate_ms(E2B_ASSISTANT_BYTES) * (row["drafter_calls"] / row["target_calls"])
    return (target_ms + (drafter_ms if row["mode"] == "assistant" else 0.0)) / row["tokens_per_target_call"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/optimum-qnn-bench-speculative"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--note", default="", help="how the machine was shared while measuring, stored with the rows")
    args = parser.parse_args()
    import tiny_gemma4_assistant

    target, assistant = models()
    held = tiny_gemma4_assistant.heldout_ids(target).tolist()
    step = max(1, (len(held) - 32) // args.prompts)
    prompts = [held[i:i + 32] for i in range(0, step * args.prompts, step)][:args.prompts]
    folders = {mode: export(mode, target, assistant, args.work) for mode in MODES}
    rows = [measure(mode, folders[mode], prompts, args.new_tokens) for mode in MODES]
    print(f"{'mode':<11}{'tok/call':>9}{'calls/100':>10}{'drafter':>9}{'emu tok/s':>10}{'same':>6}{'SM8750 ms/tok (est.)':>22}")
    for r in rows:
        r["sm8750_ms_per_token_estimate"] = sm8750_ms_per_token(r)
        print(f"{r['mode']:<11}{r['tokens_per_target_call']:>9.2f}{100 / r['tokens_per_target_call']:>10.1f}"
              f"{r['drafter_calls']:>9}{r['decode_tokens_per_s']:>10.1f}{str(r['identical']):>6}"
              f"{r['sm8750_ms_per_token_estimate']:>22.2f}")
    if args.json:
        from stored import source_commit

        args.json.write_text(json.dumps({"prompts": len(prompts), "new_tokens": args.new_tokens, "rows": rows,
                                         "note": args.note, "commit": source_commit(), "flags": COMMON}, indent=2) + "\n")


def section(rows: dict) -> str:
    """benchmarks/RESULTS.md's table of the three decodings (results.py renders it from speculative.json)."""
    if not rows:
        return ""
    lines = [[r["mode"], f"{r['tokens_per_target_call']:.2f}", f"{100 / r['tokens_per_target_call']:.1f}",
              str(r["drafter_calls"]), f"{r['decode_tokens_per_s']:.1f}", str(r["identical"]),
              f"{r['sm8750_ms_per_token_estimate']:.1f}"] for r in rows["rows"]]
    head = ["mode", "tokens per target call", "target calls / 100 tokens", "drafter calls", "emulator tok/s",
            "= plain greedy", "SM8750 ms/token (estimate)"]
    from stored import markdown

    table = markdown(head, lines) + "\n"
    return (
        "\n## Plain, lookahead and assistant decoding\n\n"
        f"benchmarks/speculative.py: the demo model exported three ways ({' '.join(rows['flags'])}; lookahead N 4 W 3 G 3; "
        f"the demo's distilled assistant, --draft-len 3), host:onnxruntime on the x86 HTP emulator, "
        f"{rows['prompts']} held-out prompts x {rows['new_tokens']} greedy tokens, each checked against plain greedy "
        f"of its own variant. {rows.get('note', '')} Commit {rows.get('commit', 'not recorded')}. The SM8750 column "
        "is an **estimate**: full-size Gemma-4-E2B's default-context decode call (its weights and caches at 84.8 GB/s, "
        "contexts.json) per target call, plus 78 MB (the E2B assistant at 8 bits, itself an estimate) per drafter call, "
        "over the tokens per target call measured here.\n\n" + table
    )


if __name__ == "__main__":
    main()
