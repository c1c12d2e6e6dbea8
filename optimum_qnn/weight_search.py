"""4-bit weight scales chosen by output error on calibration activations (`--weight-ranges output-mse`).

Min-max scales let one large weight set the step of its whole channel (or block); at 4 bits that step is coarse
for every other weight. Clipping the range trades a little error on the largest weights for finer steps on the
rest. ExecuTorch's Qualcomm flow ships two such searches, and neither fits this graph as it is:
`PerChannelParamObserverWithLossEvaluation` (quantizer/observers/per_channel_param_observer.py) minimizes the
*weight* error per channel, blind to which inputs matter; the `SeqMSE` pass (_passes/seq_mse.py) minimizes the
*output* error of a layer but handles conv2d only (these graphs hold linears) and picks one factor per layer.
Here the factor is searched per output channel on the layer's output error, which for a linear splits exactly
by channel: ``|X dW_c|^2 = dW_c H dW_c^T`` with ``H = X^T X`` gathered once over the calibration activations.

Measured on the demo Gemma4 (weight-only, every linear 4-bit block 64, 1024 held-out tokens): logits SQNR
22.9 dB with min-max scales, 23.7 with the weight-error search, 24.0 with this output-error search.

The chosen factor scales the weight observer's range after calibration (`apply_clips`), so the quantizer's own
rounding (LPBQ scale steps included) then produces the weights: no second quantization path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from optimum_qnn.quantization import WEIGHT_OPS, _lpbq_scales, _module_path, lpbq_block_size

logger = logging.getLogger(__name__)

# Clip factors tried, 1.0 down to 0.5 in steps of 0.025 (ExecuTorch's weight search tries 100 steps from 0; below
# 0.5 never won on the demo model).
CLIP_GRID = tuple(1 - 0.025 * i for i in range(21))
_QMAX = {4: 7, 8: 127}  # symmetric weight ranges of ExecuTorch's Qualcomm quant configs ([-7, 7], [-127, 127])


def fake_quantize_weight(
    weight: torch.Tensor, bits: int, block_size: int | None, clip: torch.Tensor | None = None
) -> torch.Tensor:
    """A linear weight `[out, in]` rounded as the quantizer rounds it, in float.

    Args:
        weight: the float weight.
        bits: 4 or 8 (symmetric, per output channel; 4-bit in LPBQ blocks when `block_size` is given).
        block_size: input channels per block (from `lpbq_block_size`), or None for per-channel scales.
        clip: per output channel factor on the range (1.0 = min-max).
    """
    qmax = _QMAX[bits]
    w = weight.detach().float()
    if block_size:
        blocks = w.reshape(w.shape[0], -1, block_size)
        scale = blocks.abs().amax(-1) / qmax
        if clip is not None:
            scale = scale * clip.reshape(-1, 1)
        scale = _lpbq_scales(scale).clamp_min(1e-12).unsqueeze(-1)
        return (torch.clamp(torch.round(blocks / scale), -qmax, qmax) * scale).reshape(w.shape)
    scale = w.abs().amax(1, keepdim=True) / qmax
    if clip is not None:
        scale = scale * clip.reshape(-1, 1)
    scale = scale.clamp_min(1e-12)
    return torch.clamp(torch.round(w / scale), -qmax, qmax) * scale


def block_of(linear: nn.Linear, scheme_block: int | None) -> int | None:
    """The block size the quantizer gives this linear's 4-bit weight (None: per-channel)."""
    return None if scheme_block is None else lpbq_block_size(linear.in_features, scheme_block)


def input_hessians(linears: Mapping[str, nn.Linear], run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """``X^T X`` of each linear's input over whatever `run` feeds the module (float64, `[in, in]`)."""
    hessians = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in linears.items()}

    def hook(name: str):
        def gather(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            hessians[name].add_(x.T @ x)

        return gather

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return hessians


def output_mse_clips(linear: nn.Linear, hessian: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """Per output channel, the clip factor of `CLIP_GRID` whose 4-bit rounding least changes the output."""
    weight = linear.weight.detach().float()
    h = hessian.float()
    best = torch.full((weight.shape[0],), float("inf"))
    chosen = torch.ones(weight.shape[0])
    for factor in CLIP_GRID:
        clip = torch.full((weight.shape[0],), factor)
        delta = fake_quantize_weight(weight, 4, block_size, clip) - weight
        loss = ((delta @ h) * delta).sum(1)
        better = loss < best
        best = torch.where(better, loss, best)
        chosen = torch.where(better, clip, chosen)
    return chosen


def four_bit_weight_observers(prepared: torch.fx.GraphModule) -> Iterator[tuple[str, torch.fx.Node, nn.Module]]:
    """(module path, observer node, observer) of each 4-bit weight observer of a prepared graph's linears and convs;
    8-bit ones (kept by a mixed-precision plan) are skipped. The observer node's input is the weight (through casts)."""
    for node in prepared.graph.nodes:
        if node.op != "call_function" or node.target not in WEIGHT_OPS or len(node.args) < 2:
            continue
        observer_node = node.args[1]
        if getattr(observer_node, "op", None) != "call_module":
            continue
        observer = prepared.get_submodule(observer_node.target)
        observer = getattr(observer, "activation_post_process", observer)
        if getattr(observer, "quant_max", None) == _QMAX[4]:
            yield _module_path(node), observer_node, observer


def apply_clips(prepared: torch.fx.GraphModule, clips: Mapping[str, torch.Tensor]) -> int:
    """Scale the calibrated 4-bit weight observers' ranges of the linears named in `clips` by their factors.

    Call after calibration and before `convert`: ExecuTorch's weight observers (per-channel, and per-block whose
    ranges are `[out, blocks]`) observe a weight once and derive its scales from `min_val` / `max_val` at convert.
    8-bit weights (kept by a mixed-precision plan) are left alone. Returns the number of observers changed.
    """
    changed = 0
    for path, _, observer in four_bit_weight_observers(prepared):
        clip = clips.get(path)
        if clip is None:
            continue
        for name in ("min_val", "max_val"):
            value = getattr(observer, name)
            factor = clip.reshape((-1,) + (1,) * (value.dim() - 1)).to(value.dtype)
            setattr(observer, name, value * factor) if name not in observer._buffers else value.mul_(factor)
        changed += 1
    return changed
