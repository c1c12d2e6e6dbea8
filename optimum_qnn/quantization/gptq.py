"""4-bit weight rounding chosen by output error (`--weight-rounding gptq`).

Round-to-nearest rounds each weight on its own. GPTQ (Frantar et al., 2022) rounds one input column at a time and
moves the rounding error of that column onto the columns still to be rounded, weighted by the inverse Hessian of
the layer's inputs (``H = X^T X`` over the calibration activations), so the errors of a row partly cancel in the
layer's output instead of adding up. It chooses the rounding only: the scales stay those of the quantizer.

That is what lets it live inside PT2E without a second quantization path. After calibration (and the
output-MSE clips, which fix the ranges), each 4-bit weight observer already knows the scales convert will use
(`calculate_qparams`). GPTQ runs with exactly those scales and writes back weights that lie on the grid (integer
times scale); convert then quantizes them and recovers GPTQ's integers exactly. ExecuTorch's Qualcomm flow has no
such pass for linears (its SeqMSE pass searches a scale per conv2d layer); this one follows the published algorithm
with fixed (static) group scales and no reordering of columns.

Measured on the demo Gemma4 (weight-only, every linear 4-bit block 64, benchmarks/QUANT_NOTES.md): 22.9 dB logits
SQNR with round-to-nearest, 24.7 with GPTQ; with output-MSE ranges, 24.0 and 25.4.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

_DAMPING = 0.01  # share of the mean Hessian diagonal added to it (the paper's default)
_COLUMN_BLOCK = 128  # columns rounded before their error is pushed onto the rest in one matrix product


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """The weight `[out, in]` rounded by GPTQ to `clamp(q, -qmax, qmax) * scale`, returned in float64.

    Args:
        weight: the float weight.
        hessian: ``X^T X`` of its input, `[in, in]`.
        scale: per output channel `[out]` or `[out, 1]`, or per block of input channels `[out, blocks]`.
        qmax: the symmetric integer range (7 for 4 bits).
    """
    w = weight.detach().double().clone()
    out_features, in_features = w.shape
    scale = scale.detach().double().reshape(out_features, -1)
    block = in_features // scale.shape[1]
    h = hessian.detach().double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += torch.eye(in_features, dtype=h.dtype) * (_DAMPING * torch.diag(h).mean())
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads onto the columns after it.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for start in range(0, in_features, _COLUMN_BLOCK):
        end = min(start + _COLUMN_BLOCK, in_features)
        w_block = w[:, start:end].clone()
        errors = torch.zeros_like(w_block)
        h_block = hinv[start:end, start:end]
        for i in range(end - start):
            column = w_block[:, i]
            s = scale[:, (start + i) // block]
            rounded = torch.clamp(torch.round(column / s), -qmax, qmax) * s
            q[:, start + i] = rounded
            error = (column - rounded) / h_block[i, i]
            w_block[:, i:] -= error.unsqueeze(1) * h_block[i, i:].unsqueeze(0)
            errors[:, i] = error
        w[:, end:] -= errors @ hinv[start:end, end:]
    return q


def observer_scales(observer) -> torch.Tensor:
    """The weight scales convert will use: `[out]` per channel, `[out, blocks]` per block."""
    scale, _ = observer.calculate_qparams()
    return scale.reshape(scale.shape[0], -1)


def apply_gptq(
    prepared: Mapping[str, torch.fx.GraphModule], calibrated: str, hessians: Mapping[str, torch.Tensor]
) -> int:
    """Round the 4-bit weights of the linears named in `hessians` by GPTQ, in every prepared graph alike.

    Call after calibration (and `weight_search.apply_clips`), once the observers of all graphs hold the same
    statistics, and before convert. The scales come from the observers of `prepared[calibrated]`; each weight is
    replaced (not changed in place: the float module stays the fp32 reference) by one new tensor of the weight's
    dtype, set in every graph that reads it, so the graphs still share it (and convert's memo still quantizes it
    once). Weights with 8-bit observers (kept by a mixed-precision plan) are left alone. Returns the number of
    weights rounded.
    """
    from optimum_qnn.quantization.folding import _owner, weight_attr_node
    from optimum_qnn.quantization.weight_search import _QMAX, four_bit_weight_observers

    rounded: dict[str, torch.Tensor] = {}
    graph = prepared[calibrated]
    for path, observer_node, observer in four_bit_weight_observers(graph):
        source = weight_attr_node(observer_node.args[0])
        if path not in hessians or path in rounded or source is None:
            continue
        weight = getattr(*_owner(graph, source.target))
        q = gptq_round(weight.float(), hessians[path], observer_scales(observer), _QMAX[4])
        rounded[path] = q.to(weight.dtype)
    for graph in prepared.values():
        for path, observer_node, _ in four_bit_weight_observers(graph):
            source = weight_attr_node(observer_node.args[0])
            if path in rounded and source is not None:
                owner, attr = _owner(graph, source.target)
                value = rounded[path]
                setattr(owner, attr, torch.nn.Parameter(value, requires_grad=False) if attr in owner._parameters else value)
    logger.info("GPTQ rounded %d 4-bit weights", len(rounded))
    return len(rounded)
