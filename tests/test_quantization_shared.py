"""optimum_qnn.quantization.shared and pt2e in a hybrid export: prefill and decode share every quantization parameter,
each weight is quantized once for both graphs, observers are made without copying their graph, and the bounded-memory
convert equals torchao's fold (on the toy Gemma4 of tests/toy_gemma.py)."""

from __future__ import annotations

import operator
import re

import pytest
import torch
from torch import nn

from tests.toy_gemma import PREFILL_AR, Toy, make_toy, sqnr


@pytest.fixture(scope="module")
def toy(qnn_sdk) -> Toy:
    return make_toy()


def _qparams(graph: torch.fx.GraphModule) -> list[tuple]:
    """(node name, target, scalar args, tensor args) of every Q/DQ node, in graph order."""
    params = []
    for node in graph.graph.nodes:
        # quantize/dequantize_per_tensor, dequantize_per_channel, torchao.dequantize_affine (per-block weights)
        if node.op != "call_function" or not re.search(r"quantize_(per_|affine)", str(node.target)):
            continue
        scalars, tensors = [], []
        for arg in node.args[1:]:
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                tensors.append(operator.attrgetter(arg.target)(graph))
            elif not isinstance(arg, torch.fx.Node):
                scalars.append(arg)
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and source.op == "get_attr":  # folded quantized weight
            tensors.append(operator.attrgetter(source.target)(graph))
        params.append((node.name, str(node.target), tuple(scalars), tensors))
    return params


# Decode graph quantized with the prefill graph's statistics, fake-quant vs fp32 (measured 12.8 and 38.8 dB).
SHARED_DECODE_FLOORS = {"16a4w_block": 11.0, "16a8w": 36.0}


@pytest.mark.parametrize("scheme", ["16a4w_block", pytest.param("16a8w", marks=pytest.mark.slow)])
def test_prefill_and_decode_share_quant_params(toy, scheme):
    from optimum_qnn.quantization.pt2e import make_quantizer, quantize
    from optimum_qnn.quantization.shared import quantize_shared

    programs = {"prefill": toy.export(PREFILL_AR), "decode": toy.export(1)}
    graphs = quantize_shared(programs, toy.calibrate(PREFILL_AR), make_quantizer(scheme), calibrate_on="prefill")
    prefill, decode = _qparams(graphs["prefill"]), _qparams(graphs["decode"])
    assert len(prefill) == len(decode) > 50
    for (name_p, target_p, scalars_p, tensors_p), (name_d, target_d, scalars_d, tensors_d) in zip(prefill, decode):
        assert (name_p, target_p, scalars_p) == (name_d, target_d, scalars_d)
        assert len(tensors_p) == len(tensors_d)
        assert all(torch.equal(a, b) for a, b in zip(tensors_p, tensors_d)), name_p
    if scheme == "16a4w_block":
        assert any("dequantize_affine" in target for _, target, _, _ in decode)

    # The decode graph, quantized with the prefill statistics, still tracks the float model.
    with torch.no_grad():
        logits = graphs["decode"](*toy.test_inputs)[0]
    measured = sqnr(toy.reference[0], logits)
    print(f"{scheme}: decode fake-quant with prefill statistics, SQNR vs fp32 {measured:.1f} dB")
    assert measured >= SHARED_DECODE_FLOORS[scheme]

    # Calibrating the decode graph on its own data gives other parameters: the equality above is not vacuous.
    alone = quantize(toy.export(1), toy.calibrate(1), make_quantizer(scheme))
    assert any(p[2] != d[2] for p, d in zip(_qparams(alone), decode))


@pytest.mark.parametrize("scheme", ["16a8w", "16a4w_block"])
def test_each_weight_is_quantized_once_for_both_graphs(toy, scheme):
    """With one memo, converting the decode graph after the prefill graph quantizes no weight again: it gets the
    prefill graph's integer tensors (the same objects), which equal what it would compute itself."""
    from optimum_qnn.quantization.folding import tensor_attributes
    from optimum_qnn.quantization.pt2e import convert, make_quantizer, prepare
    from optimum_qnn.quantization.shared import copy_observer_state

    quantizer = make_quantizer(scheme)
    prefill, decode, alone = (prepare(toy.export(n), quantizer) for n in (PREFILL_AR, 1, 1))
    with torch.no_grad():
        toy.calibrate(PREFILL_AR)(prefill)
    copy_observer_state(prefill, decode)
    copy_observer_state(prefill, alone)
    alone = convert(alone)
    memo: dict = {}
    prefill_graph = convert(prefill, memo)
    weights_only = {torch.ops.quantized_decomposed.quantize_per_tensor.default}  # also constants of one graph
    quantized = {key for key in memo if key[0] not in weights_only}
    decode_graph = convert(decode, memo)
    assert len(quantized) >= 7 and {key for key in memo if key[0] not in weights_only} == quantized
    first = {name: t for name, t in tensor_attributes(prefill_graph) if not t.is_floating_point()}
    ints = {name: t for name, t in tensor_attributes(decode_graph) if not t.is_floating_point() and t.dim() == 2}
    own = dict(tensor_attributes(alone))
    assert len(ints) >= 7 and all(t is first[name] for name, t in ints.items())  # the prefill graph's tensors
    assert all(torch.equal(t, own[name]) for name, t in ints.items())  # = what the decode graph computes alone


def test_observers_are_made_without_copying_the_graph_their_constructor_holds(toy, monkeypatch):
    """`pt2e.prepare` makes each observer without deep-copying its constructor (ExecuTorch's `cat` observer holds the
    whole graph; torchao copied it once per `cat`): no graph is copied, and the prepared graph, its observers and
    the converted graph after one calibration are those torchao makes with its copies."""
    import contextlib

    from executorch.backends.qualcomm.quantizer.observers.concat_observer import ConcatObserver

    from optimum_qnn.quantization import pt2e
    from optimum_qnn.quantization.pt2e import convert, make_quantizer, prepare

    copies = []
    graph_deepcopy = torch.fx.Graph.__deepcopy__
    monkeypatch.setattr(torch.fx.Graph, "__deepcopy__", lambda self, memo=None: copies.append(self) or graph_deepcopy(self, memo))
    quantizer = make_quantizer("16a4w_block")
    ours = prepare(toy.export(PREFILL_AR), quantizer)
    ours_copied = [g for g in copies if g is ours.graph]
    with monkeypatch.context() as m:
        m.setattr(pt2e, "_observer_constructors_not_copied", contextlib.nullcontext)
        torchaos = prepare(toy.export(PREFILL_AR), quantizer)
    torchaos_copied = [g for g in copies if g is torchaos.graph]
    assert ours_copied == [] and len(torchaos_copied) >= 2  # one copy per cat: what this avoids

    def observers(graph):
        return [(name, type(module).__name__, getattr(module, "dtype", None), getattr(module, "quant_min", None),
                 getattr(module, "quant_max", None), getattr(module, "block_size", None))
                for name, module in graph.named_modules() if name.startswith("activation_post_process_")]

    assert ours.code == torchaos.code and observers(ours) == observers(torchaos)
    concat = [m for _, m in ours.named_modules() if isinstance(m, ConcatObserver)]
    assert len(concat) >= 2 and all(m.concat_node.graph is ours.graph for m in concat)  # the graph itself, no copy
    with torch.no_grad():
        toy.calibrate(PREFILL_AR)(ours)
        toy.calibrate(PREFILL_AR)(torchaos)
    ours, torchaos = convert(ours), convert(torchaos)
    assert ours.code == torchaos.code
    theirs = dict(torchaos.state_dict())
    assert all(torch.equal(t, theirs[name]) for name, t in ours.state_dict().items()) and len(theirs) >= 10


def test_copy_observer_state_rejects_other_graphs(toy):
    from optimum_qnn.quantization.pt2e import make_quantizer, prepare
    from optimum_qnn.quantization.shared import copy_observer_state

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu()

    quantizer = make_quantizer("16a8w")
    toy_graph = prepare(toy.export(1), quantizer)
    other = prepare(torch.export.export(Other(), (torch.randn(1, 4),), strict=True), quantizer)
    with pytest.raises(ValueError, match="Cannot share quantization parameters"):
        copy_observer_state(toy_graph, other)


def test_quantize_rejects_uncalibrated_graph(toy):
    from optimum_qnn.quantization.pt2e import make_quantizer, quantize

    with pytest.raises(RuntimeError, match="saw no data"):
        quantize(toy.export(1), lambda prepared: None, make_quantizer("16a8w"))


@pytest.mark.parametrize("scheme", ["16a8w", "16a4w_block"])
def test_bounded_memory_convert_equals_torchao_fold(toy, scheme):
    """`quantization.convert` folds the weights' quantization as `convert_pt2e(fold_quantize=True)` does (same int
    constants, same outputs) without keeping a dequantized float copy of every weight."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    from optimum_qnn.quantization.folding import tensor_attributes
    from optimum_qnn.quantization.pt2e import convert, make_quantizer, prepare

    def calibrated():
        prepared = prepare(toy.export(1), make_quantizer(scheme))
        with torch.no_grad():
            toy.calibrate(1)(prepared)
        return prepared

    theirs = convert_pt2e(calibrated())
    ours = convert(calibrated())
    ints = lambda g: sorted((n, t) for n, t in tensor_attributes(g) if not t.is_floating_point())  # noqa: E731
    assert [n for n, _ in ints(ours)] == [n for n, _ in ints(theirs)] and ints(ours)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ints(ours), ints(theirs)))
    with torch.no_grad():
        for a, b in zip(ours(*toy.test_inputs), theirs(*toy.test_inputs)):
            assert torch.equal(a, b)
    float_bytes = sum(p.nbytes for _, p in ours.named_parameters() if p.is_floating_point())
    assert float_bytes < sum(p.nbytes for _, p in theirs.named_parameters() if p.is_floating_point())
