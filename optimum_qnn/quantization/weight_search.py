"""4-bit weight scales chosen by output error on calibration activations (`--weight-ranges output-mse`).

Min-max scales let one large weight set the step of its whole channel (or block); at 4 bits that step is coarse
for every other weight. Clipping the range trades a little error on the largest weights for finer steps on the
rest. ExecuTorch's Qualcomm flow ships two such searches, and neither fits this graph as it is:
`PerChannelParamObserverWithLossEvaluation` (quantizer/observers/per_channel_param_observer.py) minimizes the
*weight* error per channel, blind to which inputs matter; the `SeqMSE` pass (_passes/seq_mse.py) minimizes the
*output* error of a layer but handles conv2d only (these graphs hold linears) and picks one factor per layer.
Here the factor is searched per output channel on the layer's output error, which for a linear splits exactly
by channel: ``|X dW_c^T|^2`` over the linear's inputs ``X`` on the plan's samples (at most 4 x 128 tokens, the
sensitivity plan's: `input_rows`). Rows rather than ``H = X^T X``: 512 rows of a 12288-wide input are 25 MB where
its Hessian is 1.2 GB (Gemma-4-E2B's 35 layers: 1.5 GB of rows against 31.5 GB of float64 Hessians), and each
factor costs ``2 out in N`` flops rather than ``2 out in^2``.

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

from optimum_qnn.quantization.pt2e import WEIGHT_OPS, _lpbq_scales, _module_path, lpbq_block_size

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
    w = weight.detach().float()
    return _Rounding(w, bits, block_size)(clip)


class _Rounding:
    """One weight's rounding for any clip factor; the min-max scales are found once (a clip search tries 21)."""

    def __init__(self, w: torch.Tensor, bits: int, block_size: int | None):
        self.qmax, self.shape = _QMAX[bits], w.shape
        self.values = w.reshape(w.shape[0], -1, block_size) if block_size else w
        self.scale = self.values.abs().amax(-1, keepdim=not block_size) / self.qmax
        self.blocked = bool(block_size)

    def __call__(self, clip: torch.Tensor | None) -> torch.Tensor:
        scale = self.scale if clip is None else self.scale * clip.reshape(-1, 1)
        if self.blocked:
            scale = _lpbq_scales(scale).clamp_min(1e-12).unsqueeze(-1)
        else:
            scale = scale.clamp_min(1e-12)
        return (torch.clamp(torch.round(self.values / scale), -self.qmax, self.qmax) * scale).reshape(self.shape)


def block_of(linear: nn.Linear, scheme_block: int | None) -> int | None:
    """The block size the quantizer gives this linear's 4-bit weight (None: per-channel)."""
    return None if scheme_block is None else lpbq_block_size(linear.in_features, scheme_block)


def _watch_inputs(
    linears: Mapping[str, nn.Module], run: Callable[[], None], seen: Callable[[str, torch.Tensor], None]
) -> None:
    """Call `seen(name, input)` for every call of each linear while `run` feeds the module (no autograd)."""
    handles = [
        m.register_forward_pre_hook(lambda module, args, name=name: seen(name, args[0])) for name, m in linears.items()
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()


def input_hessians(linears: Mapping[str, nn.Linear], run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """``X^T X`` of each linear's input over whatever `run` feeds the module (float64, `[in, in]`)."""
    hessians = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in linears.items()}

    def gather(name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        hessians[name].add_(x.T @ x)

    _watch_inputs(linears, run, gather)
    return hessians


def input_rows(linears: Mapping[str, nn.Linear], run: Callable[[], None]) -> dict[str, list[torch.Tensor]]:
    """Each linear's input rows (float32 `[tokens, in]` chunks, one per call) over whatever `run` feeds the module.

    Linears that read the same tensor one after another (q/k/v, gate/up) share its chunk: each input costs once.
    """
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    last: list = [None, None]  # the most recent input tensor and its chunk

    def gather(name: str, x: torch.Tensor) -> None:
        if x is not last[0]:
            last[:] = [x, x.detach().reshape(-1, x.shape[-1]).float()]
        rows[name].append(last[1])

    try:
        _watch_inputs(linears, run, gather)
    finally:
        last.clear()
    return rows


def output_mse_clips(linear: nn.Linear, rows: list[torch.Tensor], block_size: int | None) -> torch.Tensor:
    """Per output channel, the clip factor of `CLIP_GRID` whose 4-bit rounding least changes the output on `rows`
    (the linear's input chunks from `input_rows`)."""
    weight = linear.weight.detach().float()
    rounding = _Rounding(weight, 4, block_size)
    best = torch.full((weight.shape[0],), float("inf"))
    chosen = torch.ones(weight.shape[0])
    for factor in CLIP_GRID:
        clip = torch.full((weight.shape[0],), factor)
        delta = (rounding(clip) - weight).T
        loss = sum((x @ delta).pow(2).sum(0) for x in rows)
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
