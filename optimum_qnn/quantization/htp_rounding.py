"""A converted (PT2E fake-quant) graph rounded where the HTP rounds differently, to predict what the .pte computes.

QNN's HTP RmsNorm truncates its quantized output: measured on the x86 emulator (QAIRT 2.49.40), op by op with every
op fed the emulator's own inputs (the toy decoder of tests/toy_gemma.py, 8a8w), each RmsNorm's output code
equals floor(x / scale) + zero_point for 92-98 % of its values and round(...) for only 52-67 %, with or without a
gamma, on v68 (QCM6490), v69 (SM8450) and v75 (SM8650) alike and at 16 bits too (floor 97-100 %); every other op of
that decoder (linear, matmul, mask add, softmax, gelu, cat, tanh, mul) rounds (94-100 %). PT2E's quantize rounds to
nearest, so at 8 bits its graph sits half a step above the HTP after every norm: on that toy the emulator's logits
measure 16.6 dB against the fake-quant graph and 26.3 dB against this one (54.4 vs 54.6 dB at 16a8w).

The lowered graph is left as it is: :func:`htp_rounding` returns a new graph over the same constants.
"""

from __future__ import annotations

import torch

_RMS_NORM = torch.ops.aten.rms_norm.default


def truncating_quantize(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """`quantize_per_tensor` as the HTP's RmsNorm quantizes its output: floor where PT2E rounds to nearest."""
    return torch.clamp(torch.floor(x * (1.0 / scale)) + zero_point, quant_min, quant_max).to(dtype)


def htp_rounding(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a converted graph whose RmsNorm outputs are quantized by truncation, as on the HTP.

    The copy shares the graph's constants (no tensor is copied); the graph itself is not changed.
    """
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default  # registered once a graph is converted
    copied = torch.fx.Graph()
    copied.output(copied.graph_copy(graph.graph, {}))
    copied._codegen = graph.graph._codegen  # the calling convention (pytree in / out) of the exported module
    simulated = torch.fx.GraphModule(graph, copied)
    for node in simulated.graph.nodes:
        if node.op == "call_function" and node.target == quantize and getattr(node.args[0], "target", None) == _RMS_NORM:
            node.target = truncating_quantize
    simulated.recompile()
    return simulated
