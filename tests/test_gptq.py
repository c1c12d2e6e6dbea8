"""GPTQ rounding of 4-bit weights (`--weight-rounding gptq`): the algorithm, and its place inside PT2E."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optimum_qnn.config import ExportConfig, QuantScheme, WeightRounding
from optimum_qnn.errors import InvalidInputError


def _correlated_inputs(n: int, features: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose channels are correlated (as a layer's activations are): what GPTQ's compensation uses. One
    distribution (the mixing matrix is fixed); `seed` draws other samples of it."""
    mix = torch.randn(features, features, generator=torch.Generator().manual_seed(123)) / features**0.5 + torch.eye(features)
    return torch.randn(n, features, generator=torch.Generator().manual_seed(seed)) @ mix


def test_gptq_rounds_onto_the_given_scales_and_lowers_the_output_error():
    from optimum_qnn.quantization.gptq import gptq_round
    from optimum_qnn.quantization.weight_search import input_hessians

    torch.manual_seed(0)
    linear = nn.Linear(128, 48, bias=False)
    x = _correlated_inputs(512, 128)
    h = input_hessians({"l": linear}, lambda: linear(x))["l"]
    w = linear.weight.detach().double()
    blocks = w.reshape(48, 2, 64)
    scale = blocks.abs().amax(-1) / 7  # per block of 64 input channels
    nearest = (torch.clamp(torch.round(blocks / scale.unsqueeze(-1)), -7, 7) * scale.unsqueeze(-1)).reshape(w.shape)
    q = gptq_round(linear.weight, h, scale, 7)

    # On the grid: an integer in [-7, 7] times its block's scale.
    levels = q.reshape(48, 2, 64) / scale.unsqueeze(-1)
    assert torch.allclose(levels, levels.round(), atol=1e-9) and levels.abs().max() <= 7
    assert not torch.equal(q, nearest)

    def output_error(weight):
        return float((x.double() @ (weight - w).T).pow(2).mean())

    # The layer's output error: GPTQ's purpose, measured on the activations it saw.
    assert output_error(q) < 0.8 * output_error(nearest), (output_error(q), output_error(nearest))
    # And on fresh activations of the same distribution: it is not fitting the calibration samples.
    x2 = _correlated_inputs(512, 128, seed=1).double()
    assert float((x2 @ (q - w).T).pow(2).mean()) < float((x2 @ (nearest - w).T).pow(2).mean())


def test_gptq_with_per_channel_scales_and_dead_inputs():
    from optimum_qnn.quantization.gptq import gptq_round

    torch.manual_seed(1)
    w = torch.randn(16, 32)
    x = _correlated_inputs(256, 32)
    x[:, 5] = 0  # an input channel that never fires: its weights cannot matter and are zeroed
    scale = w.abs().amax(1) / 7
    q = gptq_round(w, x.double().T @ x.double(), scale, 7)
    assert torch.all(q[:, 5] == 0)
    levels = q / scale.double().unsqueeze(1)
    assert torch.allclose(levels, levels.round(), atol=1e-9)


def test_weight_rounding_needs_a_4bit_scheme():
    assert WeightRounding.parse("gptq") is WeightRounding.GPTQ
    with pytest.raises(InvalidInputError, match="--weight-rounding gptq rounds 4-bit weights"):
        ExportConfig(quant=QuantScheme.A16W8, weight_rounding=WeightRounding.GPTQ)
    with pytest.raises(InvalidInputError, match="weight rounding method"):
        WeightRounding.parse("stochastic")


class _Shared(nn.Module):
    """A 4-bit linear and an 8-bit one (by override), run by two graphs of different shapes (prefill and decode)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.four = nn.Linear(128, 32, bias=False)
        self.eight = nn.Linear(128, 32, bias=False)

    def forward(self, x):
        return self.four(x) + self.eight(x)


def test_apply_gptq_rewrites_the_4bit_weights_of_every_graph_alike(qnn_sdk):
    """In PT2E: convert recovers GPTQ's integers exactly from the observers' own scales, both graphs get the same
    quantized weight (one constant), the 8-bit weight and the float module are untouched."""
    from optimum_qnn.quantization.gptq import apply_gptq, gptq_round, observer_scales
    from optimum_qnn.quantization.pt2e import WEIGHT_OPS, _module_path, convert, make_quantizer, prepare
    from optimum_qnn.quantization.shared import quantize_shared
    from optimum_qnn.quantization.weight_search import input_hessians

    model = _Shared().eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = _correlated_inputs(64, 128)
    programs = {
        "prefill": torch.export.export(model, (x[:16],), strict=True),
        "decode": torch.export.export(model, (x[:1],), strict=True),
    }
    hessians = input_hessians({"four": model.four, "eight": model.eight}, lambda: model(x))
    quantizer = make_quantizer("16a4w_block", block_size=64, overrides={r"^eight$": "16a8w"})
    seen = {}

    def calibrate(prepared):
        for i in range(0, 64, 16):
            prepared(x[i : i + 16])

    def adjust(prepared):
        graph = prepared["prefill"]
        for node in graph.graph.nodes:
            if node.target in WEIGHT_OPS and _module_path(node) == "four":
                seen["scale"] = observer_scales(graph.get_submodule(node.args[1].target))
        assert apply_gptq(prepared, "prefill", hessians) == 1  # the 8-bit weight is left alone

    graphs = quantize_shared(programs, calibrate, quantizer, calibrate_on="prefill", adjust=adjust)
    expected = gptq_round(model.four.weight, hessians["four"], seen["scale"], 7)
    expected_int = torch.round(expected.reshape(32, 2, 64) / seen["scale"].double().unsqueeze(-1)).reshape(32, 128)

    def int_weights(graph):
        return [getattr(graph, n.target) for n in graph.graph.nodes
                if n.op == "get_attr" and getattr(graph, n.target).dtype in (torch.int8, torch.uint8)
                and getattr(graph, n.target).shape == (32, 128)]

    prefill, decode = int_weights(graphs["prefill"]), int_weights(graphs["decode"])
    assert len(prefill) == 2 and len(decode) == 2
    four = [w for w in prefill if torch.equal(w.to(torch.float64), expected_int)]
    assert len(four) == 1, "convert did not recover GPTQ's integers"
    assert any(w is four[0] or torch.equal(w, four[0]) for w in decode)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # Round-to-nearest on the same scales gives other integers: GPTQ changed the weights the graphs carry.
    plain = prepare(programs["prefill"], quantizer)
    calibrate(plain)
    nearest = convert(plain)
    assert not any(torch.equal(w.to(torch.float64), expected_int) for w in int_weights(nearest))
