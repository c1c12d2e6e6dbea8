"""What the HTP compiler refuses, said before the compile (the preflight) and after it (a refused graph's message).

The TCM rule, measured with QAIRT 2.49.40 on the x86 HTP compiler (benchmarks/tcm_probe.py, rows in
benchmarks/tcm_probe.json; 2-layer Gemma4 checkpoints whose probed layer has Gemma-4-E2B's head_dim, one KV head):
a quantized export whose KV caches cross the graph boundary as uint16 (the default integer IO) needs each cache
input, over the columns one call attends to (``kv_heads x head_dim x columns x 2`` bytes), in TCM in one piece
(QNN's `q::*InputSlice`), and that piece may not exceed 8 MiB:
- head_dim 256 at 8192 and 16384 columns (4 and 8 MiB) and head_dim 512 at 8192 (8 MiB) compiled on SM8650;
- 24576 and 32768 columns at head_dim 256 (12 and 16 MiB) and 16384 at head_dim 512 (16 MiB) were refused
  (`Operator named q::*InputSlice ... not sufficiently tiled to fit in TCM. Requires 16777216 bytes`), in the decode
  and the prefill graph alike (Gemma-4-E2B at 32K failed so after 13 minutes of compile);
- the KV heads count together: 2 KV heads of head_dim 256 at 16384 (16 MiB, 8 MiB a head) were refused (E4B has 2);
- SA8797, whose VTCM ExecuTorch lists as 16 MB, refused 12 and 16 MiB too: the limit did not follow the VTCM table,
  so it is taken as the smaller of 8 MiB and the SoC's VTCM (SoCs with 2 or 4 MB were not measured);
- with float32 IO (``--float-io``: the graph quantizes the caches itself) and in fp16, 16 MiB (head_dim 256 at 32768)
  and 32 MiB (head_dim 512 at 32768) caches compiled.
The columns are ``C`` for a full-length cache (its ``C - ar`` slots plus the call's own ``ar``) and
``sliding_window + ar`` for a ring (`CacheLayout.RING`). 8a8w's uint8 caches are counted at one byte (not measured).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from optimum_qnn.config import ExportConfig, QuantScheme
from optimum_qnn.contract import AttentionKind, CacheLayout, LayerSpec
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.socs import Soc

MIB = 1 << 20
# Set to 1 to compile past the rule anyway: to measure it again (benchmarks/tcm_probe.py), or with a QAIRT that tiles more.
NO_TCM_CHECK_ENV = "OPTIMUM_QNN_NO_TCM_CHECK"

# QNN's words for a tensor it cannot tile: "Operator named q::*InputSlice (0x...) not sufficiently tiled to fit in
# TCM. Requires 16777216 bytes".
_QNN_TCM = re.compile(r"Operator named (?P<op>\S+).{0,80}?not sufficiently tiled to fit in TCM\. Requires (?P<bytes>\d+) bytes")
# What QNN prints when it refuses a graph: the op it could not create, else its first error line.
_QNN_OP_REFUSED = re.compile(r"could not create op: (\S+)")
# QNN's op validation naming the HTP arch a parameter needs: "has incorrect Value 68, expected >= 73."
_QNN_ARCH_TOO_OLD = re.compile(r"incorrect Value (?P<has>\d+), expected >= (?P<needs>\d+)")
_QNN_ERROR = re.compile(r"\[ERROR\][^:]*:\s*(?:\S+\.cc:\d+::)?(?:ERROR:)?\s*(.+)")


# The largest integer cache input measured to compile (SM8650 and SA8797 alike).
INPUT_SLICE_LIMIT = 8 * MIB


def vtcm_bytes(soc: Soc) -> int:
    """The SoC's VTCM in bytes (`socs.py` lists MiB, as ExecuTorch's `_soc_info_table` does)."""
    return soc.info.vtcm_mb * MIB


def tcm_limit(soc: Soc) -> int:
    """The largest integer cache input the HTP compiler took in one piece for ``soc`` (the rule above)."""
    return min(vtcm_bytes(soc), INPUT_SLICE_LIMIT)


def integer_io_bytes(config: ExportConfig) -> int | None:
    """Bytes per element of the caches at the graph boundary when they are integers, or None for float IO (fp16, or
    ``--float-io``), where the rule does not apply: a 16 MiB cache compiled there."""
    if config.quant is QuantScheme.FP16 or config.float_io:
        return None
    return 1 if config.quant.value.startswith("8a") else 2


@dataclass(frozen=True)
class CacheTensor:
    """The largest K or V one call of an export attends to, as the HTP compiler slices it."""

    layer: LayerSpec
    columns: int
    bytes: int

    def describe(self) -> str:
        kind = "sliding" if self.layer.attention is AttentionKind.SLIDING else "full-attention"
        return (f"layer {self.layer.index}'s K cache ({kind}: {self.layer.kv_heads} KV head(s) x head_dim "
                f"{self.layer.head_dim} x {self.columns} columns, {self.bytes} bytes)")


def cache_columns(layer: LayerSpec, context_len: int, ar_len: int, window: int | None, layout: CacheLayout) -> int:
    """Columns one call of ``ar_len`` tokens attends to in ``layer``: its cache slots plus the call's own tokens."""
    if layout is CacheLayout.RING and layer.attention is AttentionKind.SLIDING and window is not None:
        return window + ar_len
    return context_len


def largest_cache_tensor(layers: tuple[LayerSpec, ...], context_len: int, ar_lens: tuple[int, ...], window: int | None,
                         layout: CacheLayout, element_bytes: int) -> CacheTensor:
    """The largest cache tensor of any method (``ar_lens``: tokens per call of each method)."""
    candidates = [
        CacheTensor(l, cols, l.kv_heads * l.head_dim * cols * element_bytes)
        for l in layers if l.owns_cache for ar in ar_lens
        for cols in (cache_columns(l, context_len, ar, window, layout),)
    ]
    return max(candidates, key=lambda t: t.bytes)


def largest_context(layers: tuple[LayerSpec, ...], ar_lens: tuple[int, ...], window: int | None, layout: CacheLayout,
                    element_bytes: int, limit: int) -> int | None:
    """The largest context whose every cache tensor fits ``limit`` bytes, or None when even a ring's window does not."""
    growing = [l for l in layers if l.owns_cache
               and not (layout is CacheLayout.RING and l.attention is AttentionKind.SLIDING and window is not None)]
    fixed = [l for l in layers if l.owns_cache and l not in growing]
    if any(l.kv_heads * l.head_dim * (window + max(ar_lens)) * element_bytes > limit for l in fixed):
        return None
    if not growing:
        return None  # no cache grows with the context: any context the model allows
    per_column = max(l.kv_heads * l.head_dim * element_bytes for l in growing)
    return limit // per_column


def call_lengths(config: ExportConfig) -> tuple[int, ...]:
    """Tokens per call of each method the export makes: the decode call (`ExportConfig.decode_ar_len`), and the
    prefill call's where there is one."""
    decode_ar = config.decode_ar_len
    return (decode_ar, config.shapes.prefill_ar_len) if config.mode.has_prefill else (decode_ar,)


def largest_compiling_context(layers: tuple[LayerSpec, ...], window: int | None, config: ExportConfig) -> int | None:
    """The largest context every target SoC of ``config`` compiles (its layout and IO), or None when the rule sets no
    bound (float IO, or no cache grows with the context)."""
    element = integer_io_bytes(config)
    if element is None or os.environ.get(NO_TCM_CHECK_ENV) == "1":
        return None
    ar_lens = call_lengths(config)
    bounds = [largest_context(layers, ar_lens, window, config.shapes.cache_layout, element, tcm_limit(soc))
              for soc in config.socs]
    return min((b for b in bounds if b is not None), default=None)


def check_tcm(layers: tuple[LayerSpec, ...], window: int | None, config: ExportConfig) -> None:
    """Refuse, before any work, an export with a cache tensor larger than a target SoC's VTCM (the rule above).

    Raises:
        InvalidInputError: naming the tensor, its bytes, the SoC's VTCM and the largest context that compiles.
    """
    element = integer_io_bytes(config)
    if element is None or os.environ.get(NO_TCM_CHECK_ENV) == "1":
        return
    shapes = config.shapes
    ar_lens = call_lengths(config)
    tensor = largest_cache_tensor(layers, shapes.max_seq_len, ar_lens, window, shapes.cache_layout, element)
    for soc in sorted(config.socs, key=tcm_limit):
        limit = tcm_limit(soc)
        if tensor.bytes <= limit:
            continue
        best = largest_context(layers, ar_lens, window, shapes.cache_layout, element, limit)
        ring = largest_context(layers, ar_lens, window, CacheLayout.RING, element, limit) if window else None
        advice = f"--max-seq-len {best} is the largest context that compiles for {soc.value}" if best else (
            "no context compiles for it with this layout")
        if shapes.cache_layout is CacheLayout.FULL and ring is not None and best is not None and ring > best:
            advice += f" (with --cache-layout ring, {ring}: sliding layers then keep only their window)"
        raise InvalidInputError(
            f"--max-seq-len {shapes.max_seq_len} cannot compile for {soc.label}: {tensor.describe()} crosses the graph "
            f"boundary as uint16, and QNN's HTP compiler takes such an input in one piece of TCM (q::*InputSlice), at "
            f"most {limit} bytes ({limit // MIB} MiB; {soc.value} has {soc.info.vtcm_mb} MiB of VTCM). {advice}; "
            "--float-io compiles longer contexts (float32 caches at the boundary, quantized inside the graph: twice "
            f"the cache bytes per call; head_dim 512 at 32768 compiled so). Measured with QAIRT 2.49.40 (benchmarks/tcm_probe.json); {NO_TCM_CHECK_ENV}=1 "
            "compiles anyway"
        )


def tcm_refusal(native_text: str) -> tuple[str, int] | None:
    """(operator, bytes) when QNN refused a graph because a tensor does not fit its TCM, else None."""
    found = _QNN_TCM.search(native_text)
    return (found.group("op"), int(found.group("bytes"))) if found else None


def qnn_refusal_message(soc: Soc, native_text: str) -> str:
    """One paragraph for a user whose graph QNN would not compile, from what QNN printed."""
    tcm = tcm_refusal(native_text)
    if tcm is not None:
        op, needed = tcm
        return (f"QNN's HTP compiler refused a graph for {soc.value}: its operator {op} needs a tensor of {needed} "
                f"bytes ({needed / MIB:.1f} MiB) in TCM at once, and {soc.value} has {soc.info.vtcm_mb} MiB "
                f"({vtcm_bytes(soc)} bytes) of VTCM (the largest measured to compile: {tcm_limit(soc)} bytes). At long "
                "contexts that tensor is a uint16 KV cache input (KV heads x head_dim x context x 2 bytes): choose a "
                "smaller --max-seq-len, --cache-layout ring when the sliding layers' caches are the large ones, or "
                "--float-io; another --quant keeps the same cache. QNN's own output is above, and -v shows all of it.")
    ops = list(dict.fromkeys(_QNN_OP_REFUSED.findall(native_text)))
    errors = list(dict.fromkeys(m.strip() for m in _QNN_ERROR.findall(native_text)))
    said = f"it could not create {', '.join(ops[:3])}" if ops else (errors[0] if errors else "no reason printed")
    arch = _QNN_ARCH_TOO_OLD.search(" ".join(errors))
    if arch and int(arch.group("has")) == soc.htp_arch:
        why = (f"An op of the graph needs HTP v{arch.group('needs')} or newer at this precision, and {soc.value} is "
               f"v{soc.htp_arch}: another --quant may compile (docs/exporting.md lists what each arch supports).")
    else:
        why = "The graph uses an op the HTP has no kernel for at this precision, and another --quant may compile."
    return (f"QNN's HTP compiler refused a graph for {soc.value} ({said}). {why} QNN's own output is above, and -v "
            "shows all of it. Please report it with that output.")
