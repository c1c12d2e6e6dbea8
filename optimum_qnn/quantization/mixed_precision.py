"""A sensitivity-ranked mixed-precision plan for 4-bit exports (`--size-budget`).

At 4 bits the logits' error is the sum of many small ones: on the demo Gemma4 no linear class costs more than a
fifth of it (benchmarks/QUANT_NOTES.md has the table), so keeping one class (say lm_head) at 8 bits buys about
1 dB. What pays is ranking single linears by the logit error their 4-bit rounding causes *per parameter*, and
keeping the top of that list at 8 bits until the budget is spent: small, early, shared linears (the per-layer
input projections, layer 0's attention, the KV-producing k/v projections) cost far more than their size.

Each linear's effect is its weight rounded to 4 bits as the quantizer would (`weight_search.fake_quantize_weight`),
every other weight float, as the noise power it adds to the logits over their power (the inverse of an SQNR).
`measure_sensitivity` measures it exactly, one run of the calibration samples per linear: 51 runs on the demo
model, 277 on Gemma-4-E2B, whose runs of 512 tokens are about 2.3 TFLOP each (an estimate: 15 s here). The
exporter estimates it instead (`probe_sensitivity`): to first order the logits move by ``J_i dW_i x`` and, for a
random Gaussian ``v`` over the logits, ``E[(v . J_i dW_i x)^2] = |J_i dW_i x|^2``. One backward pass of
``v . logits`` gives the gradient at every linear's output, and its dot product with ``dW_i x`` is
``v . J_i dW_i x`` for all linears at once: 8 probes cost one forward and 8 backward passes whatever the number of
linears. How well that ranking matches the exact plan is measured by benchmarks/sensitivity_probe.py, whose rows
(rank correlation, linears kept, held-out SQNR) are in benchmarks/sensitivity_probe.json and QUANT_NOTES.md section 10.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from optimum_qnn.config import QuantScheme, SizeBudget
from optimum_qnn.metrics import db_of_noise, noise_of_db
from optimum_qnn.quantization.weight_search import fake_quantize_weight

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinearSensitivity:
    """What rounding one linear's weight to 4 bits does to the logits (the others float).

    Args:
        module: the linear's module path.
        params: its weight's parameter count.
        sqnr_db: logits SQNR with only this weight at 4 bits (higher: less sensitive).
        kept: whether the plan keeps it at 8 bits.
    """

    module: str
    params: int
    sqnr_db: float
    kept: bool


@dataclass(frozen=True)
class MixedPlan:
    """Which linears a 4-bit export keeps at 8 bits, and why (their measured sensitivity).

    Args:
        budget: the `--size-budget` it was planned within, e.g. `25%`.
        high: the scheme kept linears get (`16a8w`).
        rows: every linear, most sensitive per parameter first.
        probes: the random probes the sensitivities were estimated from (None: measured otherwise, e.g. exactly).
    """

    budget: str
    high: QuantScheme
    rows: tuple[LinearSensitivity, ...]
    probes: int | None = None

    @property
    def kept(self) -> tuple[str, ...]:
        return tuple(r.module for r in self.rows if r.kept)

    @property
    def kept_share(self) -> float:
        total = sum(r.params for r in self.rows)
        return sum(r.params for r in self.rows if r.kept) / total if total else 0.0

    def overrides(self) -> tuple[tuple[str, QuantScheme], ...]:
        """Quantizer overrides (exact module paths) that keep the planned linears at `high`."""
        return tuple((f"^{re.escape(name)}$", self.high) for name in self.kept)

    def table(self) -> str:
        """The per-linear sensitivity report, most sensitive per parameter first."""
        lines = [
            f"Mixed precision within --size-budget {self.budget}: {len(self.kept)} of {len(self.rows)} linears "
            f"({self.kept_share:.1%} of their weights) kept at {self.high.value}",
            f"{'linear':<44} {'params':>9} {'SQNR dB alone at 4 bit (est.)':>30}  plan",
        ]
        lines += [
            f"{r.module:<44} {r.params:>9} {r.sqnr_db:>30.1f}  {self.high.value if r.kept else '4-bit'}"
            for r in self.rows
        ]
        return "\n".join(lines)


def htp_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """The linears of the HTP graph, by module path (the embedding tables are lookups, not linears), including
    those whose weights stay in their stored dtype (`weights.UpcastLinear`)."""
    from optimum_qnn.quantization.weights import UpcastLinear

    return {name: m for name, m in module.named_modules() if isinstance(m, (nn.Linear, UpcastLinear))}


def _noise_ratio(got: torch.Tensor, ref: torch.Tensor, power: float) -> float:
    return float((got.double() - ref.double()).pow(2).mean()) / power


def measure_sensitivity(
    linears: Mapping[str, nn.Linear],
    run_logits: Callable[[], torch.Tensor],
    block_of: Callable[[nn.Linear], int | None],
    progress: Callable[[list[str]], list[str]] = lambda names: names,
) -> dict[str, float]:
    """Logits SQNR (dB) with each linear alone rounded to 4 bits.

    Args:
        linears: module path -> linear of the model `run_logits` runs.
        run_logits: runs the calibration samples through the model; returns their logits.
        block_of: the 4-bit block size of a linear (None: per channel), as the quantizer chooses it.
        progress: wraps the list of names iterated (e.g. a tqdm bar).

    Returns:
        Module path -> SQNR in dB of the logits (inf when rounding changed nothing).
    """
    with torch.no_grad():
        ref = run_logits()
        power = float(ref.double().pow(2).mean())
        out = {}
        for name in progress(list(linears)):
            linear = linears[name]
            original = linear.weight
            linear.weight = nn.Parameter(fake_quantize_weight(original, 4, block_of(linear)), requires_grad=False)
            try:
                ratio = _noise_ratio(run_logits(), ref, power)
            finally:
                linear.weight = original
            out[name] = db_of_noise(ratio)
    return out


class _StoredWeightLinear(torch.autograd.Function):
    """A linear whose backward keeps the weight as stored: F.linear on an upcast copy (bf16 weights of `weights.
    UpcastLinear`) would keep every fp32 copy alive for the backward passes (9 GB at Gemma-4-E2B's size)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


# Random probes of the logits' gradient per sensitivity estimate (how their ranking compares with the exact measure
# at 8, 16 and 32: benchmarks/sensitivity_probe.json).
PROBES = 8


def probe_sensitivity(
    model: nn.Module,
    linears: Mapping[str, nn.Module],
    run_logits: Callable[[], torch.Tensor],
    block_of: Callable[[nn.Module], int | None],
    probes: int = PROBES,
    seed: int = 0,
    progress: Callable[[range], object] = lambda steps: steps,
) -> dict[str, float]:
    """Logits SQNR (dB) with each linear alone rounded to 4 bits, estimated to first order from random probes.

    Args:
        model: the model `run_logits` runs; its parameters are frozen meanwhile (only activation gradients flow).
        linears: module path -> linear of `model`.
        run_logits: runs the calibration samples through the model with autograd on; returns their logits. A
            method that keeps state between calls must detach it (the probes see each call's own tokens).
        block_of: the 4-bit block size of a linear (None: per channel), as the quantizer chooses it.
        probes: random probe vectors (backward passes).
        seed: of the probe vectors.
        progress: wraps the range of probes iterated (e.g. a tqdm bar).

    Returns:
        Module path -> estimated SQNR in dB of the logits (inf when rounding changes nothing).
    """
    leaves: list[torch.Tensor] = []  # outputs of the first linears on each path, where the probes' gradients end
    dots = dict.fromkeys(linears, 0.0)  # per probe: v . J_i dW_i x, summed over the calls of linear i
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in linears}  # per call: the input rows
    changes: dict[str, list[torch.Tensor]] = {}  # per call: the output's 4-bit change dW_i x, flattened

    def hook(name: str):
        def record(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            call = len(inputs[name])
            inputs[name].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
            if not output.requires_grad:
                output = output.detach().requires_grad_()
                leaves.append(output)

            def dot(grad: torch.Tensor) -> None:  # the gradient is used here and freed: no probe holds them all
                dots[name] += float(torch.dot(grad.reshape(-1).float(), changes[name][call]))

            output.register_hook(dot)
            return output

        return record

    frozen = {p: p.requires_grad for p in model.parameters()}
    handles = [m.register_forward_hook(hook(name)) for name, m in linears.items()]
    for m in linears.values():  # an instance attribute, deleted below: the class's forward is untouched
        m.forward = lambda x, m=m: _StoredWeightLinear.apply(x, m.weight, m.bias)
    try:
        for p in frozen:
            p.requires_grad_(False)  # only activation gradients: no weight gradients, no inputs saved for them
        with torch.enable_grad():
            logits = run_logits()
    finally:
        for handle in handles:
            handle.remove()
        for m in linears.values():
            del m.forward
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    with torch.no_grad():  # each weight rounded once, however many calls the samples took (a token each in kv mode)
        for name, module in linears.items():
            rows = inputs.pop(name)
            if rows:
                weight = module.weight.detach().float()
                delta = fake_quantize_weight(weight, 4, block_of(module)) - weight
                change = (rows[0] if len(rows) == 1 else torch.cat(rows)) @ delta.T
                changes[name] = [c.reshape(-1) for c in change.split([r.shape[0] for r in rows])]
    power = float(logits.detach().double().pow(2).mean())
    gen = torch.Generator().manual_seed(seed)
    squares = dict.fromkeys(linears, 0.0)
    if logits.requires_grad and leaves:
        for k in progress(range(probes)):
            v = torch.randn(logits.shape, generator=gen, dtype=logits.dtype)
            dots.update(dict.fromkeys(dots, 0.0))
            torch.autograd.backward(logits, v, retain_graph=k < probes - 1, inputs=leaves)
            for leaf in leaves:
                leaf.grad = None
            for name, dot in dots.items():
                squares[name] += dot * dot / probes
    leaves.clear()
    changes.clear()
    ratios = {name: square / logits.numel() / power for name, square in squares.items()}
    return {name: db_of_noise(ratio) for name, ratio in ratios.items()}


def plan(
    sensitivity: Mapping[str, float], params: Mapping[str, int], budget: SizeBudget,
    high: QuantScheme = QuantScheme.A16W8, probes: int | None = None,
) -> MixedPlan:
    """Keep linears at `high` in order of logit noise per parameter while the budget allows; `probes` records how
    many random probes estimated `sensitivity` (`probe_sensitivity`), None when it was measured otherwise.

    Ranking by noise per parameter is the greedy answer to "most noise removed per byte spent"; a linear that
    does not fit is skipped and smaller ones further down may still fit.

    Raises:
        InvalidInputError: a GB budget below the 4-bit size of the linears (from `SizeBudget.upgradable`).
    """
    total = sum(params[name] for name in sensitivity)
    allowed = budget.upgradable(total, 4, high.weight_bits)

    order = sorted(sensitivity, key=lambda name: -noise_of_db(sensitivity[name]) / max(params[name], 1))
    rows, used = [], 0
    for name in order:
        keep = noise_of_db(sensitivity[name]) > 0 and used + params[name] <= allowed
        used += params[name] if keep else 0
        rows.append(LinearSensitivity(name, params[name], round(sensitivity[name], 2), keep))
    return MixedPlan(str(budget), high, tuple(rows), probes)
