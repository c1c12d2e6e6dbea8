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

What QNN tiles is the cache as one tensor, not attention's work: cut into inputs of at most 8 MiB that attention
never joins (the blocks layout, `CacheLayout.BLOCKS`, `ops.attention.blocked_gqa`: each block's scores on their own,
the scores joined, one softmax, each block's probabilities times its values), head_dim 512 at 16384 columns (two
blocks of 8192, 8 MiB each) compiled where the one 16 MiB input was refused (16a8w, kv, SM8650: exit 0 in 618 s). E2B's
head dims at 32768 (ring of 512 at head_dim 256, head_dim 512 in four blocks of 8192; 8 query heads, prefill 128 and
decode, 16a8w, SM8650) compiled: exit 0 in 2162 s.
In the blocks layout the largest inputs are a block, a ring, or a mask (``ar x C``, counted under the same limit
here: not measured above 8 MiB). Without ``--cache-layout`` the exporter keeps the full layout where it compiles and takes the blocks layout
where it does not (`choose_layout`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from dataclasses import dataclass

from optimum_qnn.config import ExportConfig, QuantScheme
from optimum_qnn.contract import AttentionKind, CacheLayout, LayerSpec
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.socs import Soc

stage_logger = logging.getLogger("optimum_qnn.stages")  # shown without -v
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

    layer: LayerSpec | None  # None: a mask
    columns: int
    bytes: int
    rows: int = 0  # a mask's: the call's tokens
    block: bool = False  # one block of a cache (the blocks layout)

    def describe(self) -> str:
        if self.layer is None:
            return f"the {self.rows}-token call's attention mask ({self.rows} x {self.columns} columns, {self.bytes} bytes)"
        kind = "sliding" if self.layer.attention is AttentionKind.SLIDING else "full-attention"
        block = " block" if self.block else ""
        return (f"layer {self.layer.index}'s K cache{block} ({kind}: {self.layer.kv_heads} KV head(s) x head_dim "
                f"{self.layer.head_dim} x {self.columns} columns, {self.bytes} bytes)")


def _ring(layer: LayerSpec, window: int | None, layout: CacheLayout, context_len: int) -> bool:
    """Whether ``layer`` keeps a ring of its window in ``layout`` (the blocks layout: where the window is shorter)."""
    if layout is CacheLayout.BLOCKS and window is not None and window >= context_len - 1:
        return False
    return layout is not CacheLayout.FULL and layer.attention is AttentionKind.SLIDING and window is not None


def cache_columns(layer: LayerSpec, context_len: int, ar_len: int, window: int | None, layout: CacheLayout,
                  block_len: int | None = None) -> int:
    """Columns one call of ``ar_len`` tokens attends to in ``layer`` in one piece: its cache slots plus the call's own
    tokens, or one block of the blocks layout (never joined to the call's own columns)."""
    if _ring(layer, window, layout, context_len):
        return window + ar_len
    if layout is CacheLayout.BLOCKS:
        return min(block_len, context_len - ar_len)
    return context_len


def largest_cache_tensor(layers: tuple[LayerSpec, ...], context_len: int, ar_lens: tuple[int, ...], window: int | None,
                         layout: CacheLayout, element_bytes: int, block_len: int | None = None) -> CacheTensor:
    """The largest cache tensor of any method (``ar_lens``: tokens per call of each method); in the blocks layout,
    the largest input, the masks counted too."""
    blocks = layout is CacheLayout.BLOCKS
    candidates = [
        CacheTensor(l, cols, l.kv_heads * l.head_dim * cols * element_bytes,
                    block=blocks and not _ring(l, window, layout, context_len))
        for l in layers if l.owns_cache for ar in ar_lens
        for cols in (cache_columns(l, context_len, ar, window, layout, block_len),)
    ]
    if blocks:
        candidates += [CacheTensor(None, context_len, ar * context_len * element_bytes, ar) for ar in ar_lens]
    return max(candidates, key=lambda t: t.bytes)


def largest_context(layers: tuple[LayerSpec, ...], ar_lens: tuple[int, ...], window: int | None, layout: CacheLayout,
                    element_bytes: int, limit: int) -> int | None:
    """The largest context whose every cache tensor fits ``limit`` bytes, or None when even a ring's window does not.
    In the blocks layout the caches fit at any context (more blocks); the masks set the bound."""
    growing = [l for l in layers if l.owns_cache
               and not (layout is not CacheLayout.FULL and l.attention is AttentionKind.SLIDING and window is not None)]
    fixed = [l for l in layers if l.owns_cache and l not in growing]
    if any(l.kv_heads * l.head_dim * (window + max(ar_lens)) * element_bytes > limit for l in fixed):
        return None
    if layout is CacheLayout.BLOCKS:
        return limit // (max(ar_lens) * element_bytes)
    if not growing:
        return None  # no cache grows with the context: any context the model allows
    per_column = max(l.kv_heads * l.head_dim * element_bytes for l in growing)
    return limit // per_column


def block_len_for(layers: tuple[LayerSpec, ...], window: int | None, config: ExportConfig) -> int:
    """Slots per cache block of the blocks layout: ``--cache-block-len``'s, else the most whose block of the largest
    cache fits every target SoC's limit (uint16, or 4 bytes a value for float IO), evened out over the ``C - 1``
    slots so that the last block holds the longest call's tokens (every method then reads as many blocks)."""
    shapes = config.shapes
    if shapes.cache_block_len is not None:
        return shapes.cache_block_len
    context = shapes.max_seq_len
    cut = [l for l in layers if l.owns_cache and not _ring(l, window, CacheLayout.BLOCKS, context)]
    element = integer_io_bytes(config) or 4
    per_column = max((l.kv_heads * l.head_dim * element for l in cut), default=1)
    most = max(1, min(tcm_limit(soc) for soc in config.socs) // per_column)
    blocks = math.ceil((context - 1) / most)
    return math.ceil((context - 1) / blocks)


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
    bounds = [largest_context(layers, ar_lens, window, config.shapes.cache_layout or CacheLayout.FULL, element,
                              tcm_limit(soc))
              for soc in config.socs]
    return min((b for b in bounds if b is not None), default=None)


def choose_layout(layers: tuple[LayerSpec, ...], window: int | None, config: ExportConfig) -> ExportConfig:
    """The config with its cache layout (and block length) chosen: without ``--cache-layout``, the full layout (what
    ExecuTorch's C++ runner reads) where every target compiles it, else the blocks layout, said in one line.

    Raises:
        InvalidInputError: no layout compiles the context (`check_tcm`'s refusal, naming the largest that does).
    """
    shapes = config.shapes
    layout = shapes.cache_layout
    if layout is None and config.lookahead is not None:  # a tree's mask has no ring or blocks form
        layout = CacheLayout.FULL
        config = _with_layout(config, layout)
    if layout is None:
        full = _with_layout(config, CacheLayout.FULL)
        try:
            check_tcm(layers, window, full)
            return full
        except InvalidInputError:
            blocks = _with_layout(config, CacheLayout.BLOCKS, block_len_for(layers, window, config))
            check_tcm(layers, window, blocks)  # still refused: no layout compiles it
            stage_logger.info(
                "Cache layout: blocks (caches cut into inputs of %d slots), as --max-seq-len %d cannot compile in the "
                "full layout for %s; ExecuTorch's C++ runner cannot run this variant (--cache-layout full forces "
                "its layout)", blocks.shapes.cache_block_len, shapes.max_seq_len,
                ", ".join(s.value for s in config.socs))
            return blocks
    if layout is CacheLayout.BLOCKS and shapes.cache_block_len is None:
        config = _with_layout(config, layout, block_len_for(layers, window, config))
    check_tcm(layers, window, config)
    return config


def _with_layout(config: ExportConfig, layout: CacheLayout, block_len: int | None = None) -> ExportConfig:
    return dataclasses.replace(config, shapes=dataclasses.replace(config.shapes, cache_layout=layout,
                                                                  cache_block_len=block_len))


def check_tcm(layers: tuple[LayerSpec, ...], window: int | None, config: ExportConfig) -> None:
    """Refuse, before any work, an export with a cache tensor larger than a target SoC's VTCM (the rule above).

    Raises:
        InvalidInputError: naming the tensor, its bytes, the SoC's VTCM and the largest context that compiles.
    """
    element = integer_io_bytes(config)
    if element is None or os.environ.get(NO_TCM_CHECK_ENV) == "1":
        return
    shapes = config.shapes
    layout = shapes.cache_layout or CacheLayout.FULL
    ar_lens = call_lengths(config)
    tensor = largest_cache_tensor(layers, shapes.max_seq_len, ar_lens, window, layout, element, shapes.cache_block_len)
    for soc in sorted(config.socs, key=tcm_limit):
        limit = tcm_limit(soc)
        if tensor.bytes <= limit:
            continue
        best = largest_context(layers, ar_lens, window, layout, element, limit)
        ring = largest_context(layers, ar_lens, window, CacheLayout.RING, element, limit) if window else None
        blocks = largest_context(layers, ar_lens, window, CacheLayout.BLOCKS, element, limit)
        advice = f"--max-seq-len {best} is the largest context that compiles for {soc.value}" if best else (
            "no context compiles for it with this layout")
        if layout is CacheLayout.FULL and ring is not None and best is not None and ring > best:
            advice += f" (with --cache-layout ring, {ring}: sliding layers then keep only their window)"
        if layout is not CacheLayout.BLOCKS and blocks is not None and best is not None and blocks > best:
            advice += (f"; with --cache-layout blocks (or without --cache-layout), {blocks}: caches cut into inputs "
                       "that fit, for optimum-qnn's own runtimes")
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
                "smaller --max-seq-len, --cache-layout blocks (caches cut into inputs that fit; the default where the "
                "full layout cannot compile), --cache-layout ring when the sliding layers' caches are the large ones, "
                "or --float-io; another --quant keeps the same cache. QNN's own output is above, and -v shows all of it.")
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
