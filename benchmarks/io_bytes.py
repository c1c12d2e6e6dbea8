"""Bytes that cross the graph boundary per call at Gemma-4-E2B widths: float32 IO against uint16 IO.

Every call hands the method its masks and every KV cache and gets the logits and the new K/V back; on a phone that
traffic goes through memory shared with the HTP, every decode step. The sizes come from the runner contract the
exporter builds for E2B's published text config (35 layers, 15 owning a KV cache, per-layer head_dim 256/512,
vocab 262144), so they are exact, not sampled.

Usage: python benchmarks/io_bytes.py [--contexts 1024 4096] [--prefill 128] [--layouts]
(--layouts: uint16 bytes per call with full-length caches against the ring layout, `--cache-layout ring`)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD, CacheLayout, RunnerContract  # noqa: E402
from optimum_qnn.models.gemma4.modules import gemma4_layer_specs  # noqa: E402

_BYTES = {"float32": 4, "int64": 8, "int32": 4, "uint16": 2, "uint8": 1}


# The blocks layout's block at E2B's widths: 8 MiB of uint16 at head_dim 512 (`htp_limits.block_len_for` at 32768).
E2B_BLOCK_LEN = 8192


def contracts(context: int, prefill: int, layout: CacheLayout = CacheLayout.FULL) -> tuple[RunnerContract, RunnerContract]:
    from e2b_width import e2b_config

    cfg = e2b_config()
    layers = gemma4_layer_specs(cfg)
    float_io = RunnerContract.build(
        layers, vocab_size=cfg.vocab_size, context_len=context, ar_lens={PREFILL_METHOD: prefill, DECODE_METHOD: 1},
        sliding_window=cfg.sliding_window, cache_layout=layout,
        block_len=E2B_BLOCK_LEN if layout is CacheLayout.BLOCKS else None,
    )
    names = {t.name for m in float_io.methods for t in (*m.inputs, *m.outputs)} - {"tokens", "input_pos"}
    return float_io, float_io.with_quantized_io({name: (1.0, 0, "uint16") for name in names})


def tensor_bytes(tensors) -> int:
    """The bytes of these contract tensors (static shapes and dtypes)."""
    return sum(math.prod(t.shape) * _BYTES[t.dtype] for t in tensors)


def call_bytes(contract: RunnerContract, method: str) -> tuple[int, int]:
    spec = contract.method(method)
    return tensor_bytes(spec.inputs), tensor_bytes(spec.outputs)


def table(contexts=(1024, 4096), prefill: int = 128) -> str:
    """The markdown table: per call, MiB in and out with float32 and with uint16 IO."""
    rows = []
    for context in contexts:
        f, q = contracts(context, prefill)
        for method in (DECODE_METHOD, PREFILL_METHOD):
            fi, fo = call_bytes(f, method)
            qi, qo = call_bytes(q, method)
            rows.append([
                f"{context}", method, f"{fi / 2**20:.1f} + {fo / 2**20:.2f}", f"{qi / 2**20:.1f} + {qo / 2**20:.2f}",
                f"{(fi + fo) / (qi + qo):.2f}x",
            ])
    header = ["context", "method", "float32 IO MiB (in + out)", "uint16 IO MiB (in + out)", "ratio"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def layout_table(contexts=(1024, 4096, 8192, 32768), prefill: int = 128) -> str:
    """uint16 MiB per call (inputs + outputs) with full-length caches and with the ring layout."""
    lines = ["| context | method | full layout MiB | ring layout MiB | ratio |", "|---|---|---|---|---|"]
    for context in contexts:
        full, ring = contracts(context, prefill)[1], contracts(context, prefill, CacheLayout.RING)[1]
        for method in (DECODE_METHOD, PREFILL_METHOD):
            a, b = sum(call_bytes(full, method)), sum(call_bytes(ring, method))
            lines.append(f"| {context} | {method} | {a / 2**20:.1f} | {b / 2**20:.1f} | {a / b:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--layouts", action="store_true", help="full-length caches against the ring layout")
    args = parser.parse_args()
    print(layout_table(args.contexts, args.prefill) if args.layouts else table(args.contexts, args.prefill))
    return 0


if __name__ == "__main__":
    sys.exit(main())
