"""Which precision each op of a quantized graph got: the summary table the export prints and the manifest records.

Read from the PT2E annotations of a prepared or converted graph. Split from quantization.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from optimum_qnn.quantization.pt2e import _ANNOTATION_KEY, WEIGHT_OPS, _module_path


@dataclass(frozen=True)
class QuantRow:
    """How the ops of one module were quantized (one row of the summary table).

    Args:
        module: fully qualified module path (`layers.[0-3].mlp` when layers are collapsed; `""` is the root).
        op: op name, e.g. `linear`.
        activation: output activation dtype, e.g. `uint16`; `shared` when it reuses its input's encoding.
        weight: e.g. `int4 block 64`, `int8 per-channel`; `""` for ops without a weight.
        count: how many ops the row stands for.
    """

    module: str
    op: str
    activation: str
    weight: str
    count: int = 1


def _spec_dtype(spec) -> str:
    from torchao.quantization.pt2e.quantizer import QuantizationSpec

    if not isinstance(spec, QuantizationSpec):
        return "shared"
    info = torch.iinfo(spec.dtype)
    lo = info.min if spec.quant_min is None else spec.quant_min
    hi = info.max if spec.quant_max is None else spec.quant_max
    bits = math.ceil(math.log2(hi - lo + 1))
    return f"{'u' if lo >= 0 else ''}int{bits}"


def _weight_desc(spec) -> str:
    from torchao.quantization.pt2e.quantizer import QuantizationSpec

    if not isinstance(spec, QuantizationSpec):
        return "shared"
    dtype = _spec_dtype(spec)
    keywords = getattr(getattr(spec.observer_or_fake_quant_ctr, "p", None), "keywords", {}) or {}
    if keywords.get("block_size") is not None:
        return f"{dtype} block {keywords['block_size'][1]}"
    if spec.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine):
        return f"{dtype} per-channel"
    return f"{dtype} per-tensor"


_LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)(?=\.|$)")


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], None
    values = sorted(set(indices))
    for i, value in enumerate(values):
        start = value if start is None else start
        if i + 1 == len(values) or values[i + 1] != value + 1:
            out.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(out)


def quant_summary(graph: torch.fx.GraphModule, *, collapse_layers: bool = True) -> list[QuantRow]:
    """Rows saying which precision each annotated op got, read from the PT2E annotations.

    Works on a prepared or converted graph module (annotations survive `convert_pt2e`). Layout ops that reuse
    their input's encoding (view, permute, ...) and unannotated ops (the CPU embedding lookups) are left out.

    Args:
        graph: the prepared or converted graph module.
        collapse_layers: merge rows that differ only in the layer index, written `layers.[0-3,5].q_proj`.

    Returns:
        Rows in graph order, identical rows merged (their `count` summed).
    """
    merged: dict[tuple[str, str, str, str], tuple[int, list[int]]] = {}
    for node in graph.graph.nodes:
        annotation = node.meta.get(_ANNOTATION_KEY)
        if node.op != "call_function" or annotation is None:
            continue
        module = _module_path(node)
        layer = None
        if collapse_layers and (match := _LAYER_RE.search(module)):
            layer = int(match.group(2))
            module = module[: match.start(2)] + "{}" + module[match.end(2) :]
        op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        weight = ""
        specs = list(annotation.input_qspec_map.values())
        if node.target in WEIGHT_OPS and len(specs) > 1:
            # Annotators map the activation first and the weight second (convert_pt2e replaces the weight
            # node itself, so look it up by position, not by node).
            weight = _weight_desc(specs[1])
        activation = _spec_dtype(annotation.output_qspec) if annotation.output_qspec is not None else "-"
        if activation == "shared" and not weight:
            continue  # layout ops (view, permute, ...) reuse their input's encoding: nothing to report
        key = (module, op, activation, weight)
        count, layers = merged.get(key, (0, []))
        merged[key] = (count + 1, layers + ([layer] if layer is not None else []))
    rows = []
    for (module, op, activation, weight), (count, layers) in merged.items():
        if layers:
            label = _ranges(layers)
            module = module.replace("{}", label if "," not in label and "-" not in label else f"[{label}]")
        rows.append(QuantRow(module, op, activation, weight, count))
    return rows


def format_quant_summary(rows: list[QuantRow]) -> str:
    """A plain-text table of :func:`quant_summary` rows."""
    header = ("module", "op", "activation", "weight", "count")
    table = [header] + [(r.module or "<root>", r.op, r.activation, r.weight or "-", str(r.count)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
