"""Which KV cache sizes QNN's HTP compiler can tile into VTCM: tiny Gemma4 checkpoints with E2B's real head dims.

Gemma-4-E2B at --max-seq-len 32768 failed after 13 minutes of compile with `q::*InputSlice ... not sufficiently tiled
to fit in TCM`. The cost of that compile is the model's width, not the cache: a checkpoint of one or two layers, a
64-wide hidden state and E2B's per-layer head dims (256 sliding, 512 full, one KV head) makes the same cache tensors
in about a minute. Each case runs `python -m optimum_qnn export` in a child process (the command users type) and
records its exit status, seconds and the TCM line QNN printed.

Usage: python benchmarks/tcm_probe.py --contexts 8192 16384 32768 --kinds sliding full --quant fp16 16a8w
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

_TCM = re.compile(r"Operator named (\S+).*?not sufficiently tiled to fit in TCM\. Requires (\d+) bytes")


def checkpoint(folder: Path, kind: str, max_pos: int, kv_heads: int = 1, heads: int = 2) -> Path:
    """Two decoder layers, sliding then full (transformers forces the last layer to full attention), at E2B's KV
    heads (1) and window 512. The probed kind has E2B's head_dim (sliding 256, full 512); the other kind has 32, so
    its cache is 8 (or 16) times smaller and never the one QNN refuses. ``both``: E2B's two head dims at once.
    ``heads``: query heads (E2B has 8: a prefill call's scores are then ``8 x ar`` rows per KV head, as at full size)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    path = folder / (f"{kind}_{max_pos}" + (f"_kv{kv_heads}" if kv_heads != 1 else "") + (f"_h{heads}" if heads != 2 else ""))
    if (path / "config.json").is_file():
        return path
    head_dim, global_head_dim = {"sliding": (256, 32), "full": (32, 512), "both": (256, 512)}[kind]
    cfg = Gemma4TextConfig(
        vocab_size=256, vocab_size_per_layer_input=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, global_head_dim=global_head_dim,
        num_global_key_value_heads=kv_heads, attention_k_eq_v=False, layer_types=["sliding_attention", "full_attention"], sliding_window=512, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, final_logit_softcapping=30.0, max_position_embeddings=max_pos,
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    torch.manual_seed(0)
    Gemma4ForCausalLM(cfg).save_pretrained(path)
    return path


def run_case(model: Path, out: Path, context: int, quant: str, soc: str, mode: str, extra: list[str]) -> dict:
    argv = [sys.executable, "-m", "optimum_qnn", "export", "-m", str(model), "-o", str(out), "--soc", soc,
            "--quant", quant, "--max-seq-len", str(context), "--mode", mode, "--no-weight-sharing", "-v", *extra]
    # The export's preflight refuses what the rule predicts QNN refuses: the probe asks QNN itself.
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OPTIMUM_QNN_NO_TCM_CHECK": "1"}
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=HERE.parent)
    seconds = round(time.monotonic() - start, 1)
    text = proc.stdout + proc.stderr
    tcm = _TCM.search(text)
    tail = [line for line in text.splitlines() if "rror" in line and "Enum subclass" not in line][-3:]
    return {"exit": proc.returncode, "seconds": seconds, "tcm_op": tcm.group(1) if tcm else None,
            "tcm_bytes": int(tcm.group(2)) if tcm else None, "errors": tail}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--kinds", nargs="+", default=["sliding", "full"])
    p.add_argument("--quant", nargs="+", default=["fp16"])
    p.add_argument("--soc", nargs="+", default=["SM8650"])
    p.add_argument("--mode", default="kv")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--heads", type=int, default=2, help="query heads (E2B: 8)")
    p.add_argument("--work", type=Path, default=Path("/tmp/tcm"))
    p.add_argument("--results", type=Path, default=HERE / "tcm_probe.json")
    p.add_argument("extra", nargs="*", help="more export arguments (after --)")
    args = p.parse_args()
    rows = json.loads(args.results.read_text()) if args.results.is_file() else []
    for kind in args.kinds:
        for context in args.contexts:
            model = checkpoint(args.work, kind, max(context, 8192), args.kv_heads, args.heads)
            for quant in args.quant:
                for soc in args.soc:
                    out = args.work / f"out_{kind}_{context}_{quant}_{soc}_{args.mode}_kv{args.kv_heads}_h{args.heads}"
                    row = {"kind": kind, "head_dim": {"sliding": 256, "full": 512, "both": 512}[kind], "kv_heads": args.kv_heads,
                           **({"heads": args.heads} if args.heads != 2 else {}), "context": context,
                           "quant": quant, "soc": soc, "mode": args.mode, "extra": args.extra}
                    row.update(run_case(model, out, context, quant, soc, args.mode, args.extra))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    args.results.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
