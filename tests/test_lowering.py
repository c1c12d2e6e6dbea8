"""optimum_qnn.exporter.lowering: real QNN compiles (QAIRT 2.49.40 libraries) and runs on the x86 HTP emulator.

Each lowering costs seconds, so the lowered programs are module-scoped fixtures shared by the checks.

Tolerances (HTP on the x86 emulator vs fp32 eager, measured on these tiny graphs):
    fp16: max abs error <= 5e-3 and cosine >= 0.99999 (measured: max abs error <= 1.1e-3, cosine >= 0.9999994);
    16a8w PT2E: max abs error to the fake-quantized graph <= 1e-3 (the HTP runs the same integer math), and cosine
    to the float model >= 0.99.
"""

from __future__ import annotations

import logging
import os
import signal

import torch
from torch import nn

import pytest

from optimum_qnn.config import Soc
from optimum_qnn.artifacts.inspection.pte import qnn_delegates
from optimum_qnn.exporter.delegation import format_delegation
from optimum_qnn.exporter.lowering import compile_specs, lower_to_pte

FP16_MAX_ABS = 5e-3
FP16_MIN_COSINE = 0.99999
CONTEXT_LEN = 8  # C: past cache slots + the tokens of one call
MASKED = -255.0  # additive mask value of an fp16 build (0 = attend)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def assert_close_fp16(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    err = (out - ref).abs().max().item()
    assert err <= FP16_MAX_ABS, f"max abs error {err:.3g} > {FP16_MAX_ABS}"
    assert _cosine(out, ref) >= FP16_MIN_COSINE


class TinyAttention(nn.Module):
    """RMSNorm -> q/k/v projections -> softmax attention over [past cache ++ new] with an additive mask -> o_proj.

    Inputs: x [1, ar, D], mask [1, 1, ar, C], k_cache and v_cache [1, H, C - ar, hd].
    Outputs: y [1, ar, D] and the new k, v [1, H, ar, hd] (what a runner writes into its cache).
    """

    def __init__(self, dim: int = 64, heads: int = 2, head_dim: int = 32):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm_weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(1, -1, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x, mask, k_cache, v_cache):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        q, k, v = self._heads(self.q_proj(h)), self._heads(self.k_proj(h)), self._heads(self.v_proj(h))
        keys, values = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
        scores = q @ keys.transpose(-1, -2) * self.head_dim**-0.5 + mask
        y = (torch.softmax(scores, dim=-1) @ values).transpose(1, 2).reshape(1, -1, self.heads * self.head_dim)
        return self.o_proj(y), k, v


def attention_inputs(module: TinyAttention, ar_len: int, n_past: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Inputs for one call: `n_past` valid cache slots (of C - ar_len), causal among the `ar_len` new tokens."""
    g = torch.Generator().manual_seed(seed)
    past = CONTEXT_LEN - ar_len
    mask = torch.full((1, 1, ar_len, CONTEXT_LEN), MASKED)
    mask[..., :n_past] = 0
    mask[..., past:] = torch.full((ar_len, ar_len), MASKED).triu(1)
    cache_shape = (1, module.heads, past, module.head_dim)
    return (torch.randn(1, ar_len, module.norm_weight.numel(), generator=g), mask,
            torch.randn(cache_shape, generator=g), torch.randn(cache_shape, generator=g))


def run_method(pte, method: str, inputs) -> list[torch.Tensor]:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)  # keep the Program alive while its method runs
    return list(program.load_method(method).execute(list(inputs)))


# --- fixtures: lowered programs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    return nn.Linear(32, 16).eval(), (torch.randn(4, 32),)


@pytest.fixture(scope="module")
def linear_pte(qnn_sdk, linear, tmp_path_factory):
    module, inputs = linear
    lowered = lower_to_pte({"forward": (module, inputs)}, Soc.SM8650, fp16=True)
    return lowered, lowered.write(tmp_path_factory.mktemp("linear") / "linear.pte")


@pytest.fixture(scope="module")
def attention():
    torch.manual_seed(0)
    return TinyAttention().eval()


@pytest.fixture(scope="module")
def hybrid_inputs(attention):
    return {
        "prefill_forward": attention_inputs(attention, ar_len=4, n_past=2, seed=1),
        "kv_forward": attention_inputs(attention, ar_len=1, n_past=5, seed=2),
    }


CONSTANTS = {"get_max_seq_len": CONTEXT_LEN, "get_ar_len": 4, "get_logits_scale": 0.25}


def _lower_hybrid(attention, hybrid_inputs, weight_sharing: bool):
    # Exported programs in (the pipeline's form); decode and prefill share one module, hence one set of weights.
    programs = {name: torch.export.export(attention, inputs, strict=True) for name, inputs in hybrid_inputs.items()}
    return lower_to_pte(programs, Soc.SM8650, fp16=True, constant_methods=CONSTANTS, weight_sharing=weight_sharing)


@pytest.fixture(scope="module")
def hybrid_pte(qnn_sdk, attention, hybrid_inputs, tmp_path_factory):
    """Two methods, weights NOT shared: the variant the x86 emulator can load."""
    lowered = _lower_hybrid(attention, hybrid_inputs, weight_sharing=False)
    return lowered, lowered.write(tmp_path_factory.mktemp("hybrid") / "hybrid.pte")


@pytest.fixture(scope="module")
def hybrid_shared_pte(qnn_sdk, attention, hybrid_inputs, tmp_path_factory):
    """Two methods sharing weights inside one context: the on-device variant."""
    lowered = _lower_hybrid(attention, hybrid_inputs, weight_sharing=True)
    return lowered, lowered.write(tmp_path_factory.mktemp("hybrid_shared") / "hybrid_shared.pte")


# --- single graph -----------------------------------------------------------------------------------------------


def test_linear_is_fully_delegated(linear_pte):
    lowered, _ = linear_pte
    assert lowered.delegation["forward"].fully_delegated
    assert lowered.delegation["forward"].delegated >= 1


def test_linear_delegate_is_an_htp_context_binary_for_sm8650(linear_pte):
    lowered, _ = linear_pte
    (delegate,) = qnn_delegates(lowered.buffer)
    assert delegate.method == "forward"
    assert delegate.targets == {("SM8650", 75)}
    assert b"v2.49.40" in bytes(delegate.binary)  # the QAIRT build that compiled it


def test_linear_runs_on_the_emulator(linear_pte, linear):
    _, path = linear_pte
    module, inputs = linear
    (out,) = run_method(path, "forward", inputs)
    with torch.no_grad():
        assert_close_fp16(out, module(*inputs))


@pytest.mark.parametrize("soc", [Soc.SM8550, Soc.SM8750, Soc.SM8850], ids=lambda s: s.value)
def test_linear_compiles_for_soc(qnn_sdk, linear, soc):
    module, inputs = linear
    lowered = lower_to_pte({"forward": (module, inputs)}, soc, fp16=True)
    (delegate,) = qnn_delegates(lowered.buffer)
    assert delegate.targets == {(soc.value, soc.htp_arch)}


def test_ops_left_on_cpu_are_reported_by_name(qnn_sdk):
    class WithErf(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 8)

        def forward(self, x):
            return torch.erf(torch.relu(self.proj(x))) * 2.0

    torch.manual_seed(0)
    module, x = WithErf().eval(), torch.randn(2, 16)
    # erf: no QNN builder in executorch 1.5.1; relu: supported, but kept on the CPU on request.
    lowered = lower_to_pte({"forward": (module, (x,))}, Soc.SM8650, fp16=True, skip_ops={"aten.relu.default"})
    delegation = lowered.delegation["forward"]
    assert delegation.on_cpu == {"aten.erf.default": 1, "aten.relu.default": 1}
    assert delegation.partitions == 2 and not delegation.fully_delegated
    assert "aten.erf.default x1, aten.relu.default x1" in format_delegation(lowered.delegation)
    (out,) = run_method(lowered.buffer, "forward", (x,))
    with torch.no_grad():
        assert_close_fp16(out, module(x))


def _quantized_mlp(calibration_steps: int) -> tuple[nn.Module, torch.Tensor, torch.fx.GraphModule]:
    """A float MLP, an input, and its 16a8w PT2E graph (QnnQuantizer) calibrated on random inputs and the input."""
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    x = torch.randn(4, 32)
    quantizer = QnnQuantizer(soc_model=QcomChipset.SM8650)
    quantizer.set_default_quant_config(QuantDtype.use_16a8w, is_linear_per_channel=True)
    prepared = prepare_pt2e(torch.export.export(model, (x,), strict=True).module(), quantizer)
    for _ in range(calibration_steps):
        prepared(torch.randn(4, 32))
    prepared(x)
    return model, x, convert_pt2e(prepared)


def test_pt2e_quantized_graph_lowers_and_runs(qnn_sdk):
    model, x, converted = _quantized_mlp(8)

    lowered = lower_to_pte({"forward": torch.export.export(converted, (x,), strict=True)}, Soc.SM8650, fp16=False)
    assert lowered.delegation["forward"].fully_delegated  # quantize/dequantize included
    (out,) = run_method(lowered.buffer, "forward", (x,))
    with torch.no_grad():
        assert (out - converted(x)).abs().max().item() <= 1e-3
        # Loose: measures the quantizer's default observers (0.994 here), not the lowering.
        assert _cosine(out, model(x)) >= 0.99


def test_edge_conversion_keeps_each_node_s_oldest_source_only(qnn_sdk, monkeypatch):
    """`edge.prune_provenance` between the edge passes: the edge program and every node's debug handle (ExecuTorch's,
    from the node's oldest source) are those of the conversion that keeps every node's whole provenance record,
    whose records grow with each pass."""
    from optimum_qnn.exporter import edge as edge_module
    from optimum_qnn.exporter.lowering import EdgeLowering

    _, x, converted = _quantized_mlp(8)

    def converted_to_edge():
        lowering = EdgeLowering({"forward": torch.export.export(converted, (x,), strict=True)}, fp16=False)
        lowering.prepare()
        return lowering._edge.exported_program("forward")

    def levels(source) -> int:
        return 1 + max((levels(s) for s in source.from_node), default=0)

    def described(program):
        nodes = [n for n in program.graph.nodes if n.op not in ("placeholder", "output")]
        handles = [(n.name, n.meta.get("debug_handle")) for n in nodes]
        depth = max(levels(s) for n in nodes for s in n.meta.get("from_node", []))
        return program.graph_module.code, handles, depth

    pruned_code, pruned_handles, pruned_depth = described(converted_to_edge())
    monkeypatch.setattr(edge_module, "prune_provenance", lambda graph_module: None)
    monkeypatch.setattr(edge_module, "_pruned_after_each", list)
    code, handles, depth = described(converted_to_edge())
    assert pruned_code == code and pruned_handles == handles
    assert sum(1 for _, h in handles if h) >= 5  # ExecuTorch did number them, from each node's oldest source
    assert pruned_depth <= 3 < depth  # what each pass had to copy


def test_a_portable_lowering_lowers_in_another_process(qnn_sdk, run_python, tmp_path):
    """`EdgeLowering.portable()` is what a Ray cell receives: a PT2E-quantized graph saved with torch.export, which
    a fresh interpreter (no quantizer imported) loads and lowers into the program this process makes from the
    same graph: the same QNN contexts (graphs, IO, encodings) and bit-equal outputs on the emulator."""
    import pickle

    from optimum_qnn.artifacts.inspection import inspect_bytes
    from optimum_qnn.exporter.lowering import EdgeLowering

    _, x, converted = _quantized_mlp(0)
    portable = EdgeLowering({"forward": (converted, (x,))}, fp16=False, constant_methods={"get_ar_len": 4}).portable()
    (tmp_path / "portable.pickle").write_bytes(pickle.dumps(portable))
    code = (
        "import pickle, sys\n"
        "from optimum_qnn.config import Soc\n"
        "from optimum_qnn.exporter.lowering import EdgeLowering\n"
        "lowering = EdgeLowering.from_portable(pickle.load(open(sys.argv[1], 'rb')))\n"
        "lowering.lower(Soc.SM8650, path=sys.argv[2], keep=False)\n"
    )
    proc = run_python("-c", code, str(tmp_path / "portable.pickle"), str(tmp_path / "there.pte"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    there = (tmp_path / "there.pte").read_bytes()
    here = EdgeLowering.from_portable(pickle.loads((tmp_path / "portable.pickle").read_bytes())).lower(
        Soc.SM8650, keep=False
    ).buffer
    assert inspect_bytes(there).to_dict() == inspect_bytes(here).to_dict()
    (tmp_path / "here.pte").write_bytes(here)
    for out, ref in zip(run_method(tmp_path / "there.pte", "forward", (x,)), run_method(tmp_path / "here.pte", "forward", (x,)),
                        strict=True):
        assert torch.equal(out, ref)


def test_compile_specs_refuse_weight_sharing_for_one_graph(qnn_sdk):
    with pytest.raises(ValueError, match="multiple_graphs"):
        compile_specs(Soc.SM8650, fp16=True, weight_sharing=True)


def test_malformed_skip_op_names_are_refused(linear):
    with pytest.raises(ValueError, match="'aten.embedding.default'"):
        lower_to_pte({"forward": linear}, Soc.SM8650, fp16=True, skip_ops={"torch.ops.aten.embedding.default"})


# --- two methods in one .pte ------------------------------------------------------------------------------------


def test_hybrid_methods_and_constants(hybrid_pte):
    from executorch.runtime import Runtime

    _, path = hybrid_pte
    program = Runtime.get().load_program(path)
    assert set(program.method_names) == {"prefill_forward", "kv_forward", *CONSTANTS}
    for name, value in CONSTANTS.items():
        assert program.load_method(name).execute([]) == [value]


def test_hybrid_both_methods_fully_delegated(hybrid_pte):
    lowered, _ = hybrid_pte
    assert set(lowered.delegation) == {"prefill_forward", "kv_forward"}
    assert all(d.fully_delegated for d in lowered.delegation.values()), format_delegation(lowered.delegation)


def test_hybrid_methods_share_one_context_binary_stored_once(hybrid_pte):
    lowered, _ = hybrid_pte
    delegates = qnn_delegates(lowered.buffer)
    assert sorted(d.method for d in delegates) == ["kv_forward", "prefill_forward"]
    first, second = (bytes(d.binary) for d in delegates)
    assert first == second  # one context holding both graphs ...
    assert b"prefill_forward" in first and b"kv_forward" in first
    assert len(lowered.buffer) < 2 * len(first)  # ... serialized once


@pytest.mark.parametrize("method", ["prefill_forward", "kv_forward"])
def test_hybrid_method_matches_eager_on_emulator(hybrid_pte, attention, hybrid_inputs, method):
    _, path = hybrid_pte
    outputs = run_method(path, method, hybrid_inputs[method])
    with torch.no_grad():
        expected = attention(*hybrid_inputs[method])
    assert len(outputs) == len(expected)
    for out, ref in zip(outputs, expected):
        assert_close_fp16(out, ref)


def test_weight_sharing_stores_the_weights_once(hybrid_pte, hybrid_shared_pte, attention):
    shared, _ = hybrid_shared_pte
    separate, _ = hybrid_pte
    assert shared.weight_sharing and not separate.weight_sharing
    shared_ctx = qnn_delegates(shared.buffer)[0].binary
    separate_ctx = qnn_delegates(separate.buffer)[0].binary
    weight_bytes = 2 * sum(p.numel() for p in attention.parameters())  # fp16
    # Without sharing the context carries a second copy of the weights.
    assert len(separate_ctx) - len(shared_ctx) >= 0.9 * weight_bytes
    assert all(d.fully_delegated for d in shared.delegation.values())


def test_one_edge_conversion_serves_several_socs(qnn_sdk, attention, hybrid_inputs, hybrid_pte, monkeypatch):
    """`EdgeLowering` converts the graphs to the edge dialect once; each SoC's program then holds what a lowering
    of its own holds (the same contexts, graphs, IO and encodings as read back by QNN, for its own SoC) and computes
    the same on the emulator, and lowering for one SoC leaves the edge programs as they were for the next."""
    from optimum_qnn.artifacts.inspection import inspect_bytes
    from optimum_qnn.exporter import lowering

    conversions = []
    for name in ("to_edge", "to_edge_in_parallel"):  # one method per process, or all in this one
        monkeypatch.setattr(lowering, name, lambda *a, _f=getattr(lowering, name), **k: conversions.append(1) or _f(*a, **k))
    programs = {name: torch.export.export(attention, inputs, strict=True) for name, inputs in hybrid_inputs.items()}
    shared = lowering.EdgeLowering(programs, fp16=True, constant_methods=CONSTANTS)

    def held() -> dict[str, list[str]]:  # the weights and constants each edge program holds
        return {name: [*ep.state_dict, *ep.constants] for name in hybrid_inputs
                for ep in [shared._edge.exported_program(name)]}

    shared.prepare()
    before = held()
    assert all(before.values())
    first = shared.lower(Soc.SM8750, weight_sharing=False)
    assert held() == before  # the first SoC's lowering removed nothing from the edge programs the next one lowers
    second = shared.lower(Soc.SM8650, weight_sharing=False, keep=False)
    assert not shared.prepared and conversions == [1]

    alone = hybrid_pte[0]  # this module's own lowering of the same graphs for SM8650
    assert inspect_bytes(second.buffer).to_dict() == inspect_bytes(alone.buffer).to_dict()
    assert second.delegation == alone.delegation and len(second.buffer) == len(alone.buffer)
    assert {c.soc for c in inspect_bytes(first.buffer).contexts} == {"SM8750"}
    assert all(d.fully_delegated for d in first.delegation.values())

    path = hybrid_pte[1].with_name("second_soc.pte")
    path.write_bytes(second.buffer)
    for method, inputs in hybrid_inputs.items():
        for out, ref in zip(run_method(path, method, inputs), run_method(hybrid_pte[1], method, inputs), strict=True):
            assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="consumed"):
        shared.lower(Soc.SM8650)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a kept lowering forks on Linux only")
def test_a_kept_lowering_runs_in_a_child_and_makes_what_this_process_would(qnn_sdk, attention, hybrid_inputs,
                                                                          monkeypatch, caplog):
    """A SoC lowered with keep=True runs in a forked child: this process's QNN counters do not move, so the next
    lowering here makes the same program (but for the clock-stamped context signatures); the child's errors and its
    death come back as errors here."""
    from optimum_qnn.artifacts.inspection.pte import normalized_program
    from optimum_qnn.errors import InvalidInputError
    from optimum_qnn.exporter import forked, lowering

    children = []
    Forked = lowering.Forked
    monkeypatch.setattr(lowering, "Forked", lambda fn, what, hint="", records=None: children.append(what) or Forked(fn, what, hint, records))
    programs = {name: torch.export.export(attention, inputs, strict=True) for name, inputs in hybrid_inputs.items()}
    shared = lowering.EdgeLowering(programs, fp16=True, constant_methods=CONSTANTS)
    with caplog.at_level(logging.INFO, logger="optimum_qnn.progress"):
        kept = [shared.lower(Soc.SM8750, weight_sharing=False) for _ in range(2)]
    assert children == ["the lowering for SM8750"] * 2
    # The child's progress steps reach this process's loggers (and so its progress display) through the pipe.
    steps = [r.getMessage() for r in caplog.records if r.name == "optimum_qnn.progress"]
    assert steps.count("Lowering step: serializing the program") == 2, steps

    def fail(*args, **kwargs):
        raise InvalidInputError("refused in the child")

    with monkeypatch.context() as m:
        m.setattr(lowering, "lower_edge", fail)
        with pytest.raises(InvalidInputError, match="refused in the child"):
            shared.lower(Soc.SM8750, weight_sharing=False)
        m.setattr(lowering, "lower_edge", lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
        with pytest.raises(RuntimeError, match="killed by signal SIGKILL .*: export fewer SoCs at once"):
            shared.lower(Soc.SM8750, weight_sharing=False)
    assert not forked.parallel_compile._live  # no child left registered with the memory sampler
    here = shared.lower(Soc.SM8750, weight_sharing=False, keep=False)
    assert len(children) == 4
    assert normalized_program(kept[0].buffer) == normalized_program(kept[1].buffer) == normalized_program(here.buffer)
    assert kept[0].delegation == here.delegation


def test_a_soc_s_copy_of_the_edge_programs_shares_their_weights(qnn_sdk, attention, hybrid_inputs):
    from optimum_qnn.exporter.edge import copy_sharing_tensors
    from optimum_qnn.exporter.lowering import EdgeLowering

    programs = {name: torch.export.export(attention, inputs, strict=True) for name, inputs in hybrid_inputs.items()}
    shared = EdgeLowering(programs, fp16=True)
    shared.prepare()
    copy = copy_sharing_tensors(shared._edge)
    for name in hybrid_inputs:
        original, copied = shared._edge.exported_program(name), copy.exported_program(name)
        assert copied is not original and copied.graph_module is not original.graph_module
        assert copied.state_dict is not original.state_dict and copied.constants is not original.constants
        assert original.state_dict and all(copied.state_dict[k] is t for k, t in original.state_dict.items())


@pytest.mark.slow
def test_x86_emulator_cannot_load_weight_shared_context(hybrid_shared_pte, run_python, qnn_sdk):
    # Pins a limitation of the QAIRT 2.49.40 x86 emulator; when this fails, emulator tests can use sharing too.
    _, path = hybrid_shared_pte
    code = (
        "from optimum_qnn.sdk import ensure_qnn_sdk; ensure_qnn_sdk()\n"
        "from executorch.runtime import Runtime\n"
        f"Runtime.get().load_program({str(path)!r}).load_method('kv_forward')\n"
        "print('LOADED')\n"
    )
    result = run_python("-c", code)
    assert "LOADED" not in result.stdout and result.returncode != 0
    assert "Shared weights buffer isn't supported on this platform" in result.stdout + result.stderr


# (scheme, rows) -> SQNR floor in dB; measured 65.3 / 62 (fp16) and 78.3 / 78.0 (16a8w) per row at worst.
SOFTCAP_CASES = {("fp16", 1): 58.0, ("fp16", 16): 58.0, ("16a8w", 1): 70.0, ("16a8w", 16): 70.0}


@pytest.mark.parametrize(("scheme", "rows"), list(SOFTCAP_CASES), ids=lambda v: str(v))
def test_softcap_on_the_htp(qnn_sdk, scheme, rows):
    """Gemma4's logit soft-capping after the lm_head, as a decode (1 row) and a prefill (16 rows), fp16 and
    16a8w: every row matches the eager / fake-quant graph. Each graph's form in the other precision measured
    -2.4 dB (16a8w, rows 2..) and 40.5 dB (fp16, 1 row) here; see optimum_qnn/ops/softcap.py."""
    from optimum_qnn.config import QuantScheme
    from optimum_qnn.ops.softcap import softcap
    from optimum_qnn.quantization.pt2e import make_quantizer, quantize

    class LmHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(64, 256, bias=False)

        def forward(self, h):
            return softcap(self.lm_head(h), 30.0, quantized=scheme != "fp16")

    torch.manual_seed(0)
    model = LmHead().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits well into the saturation, as a trained model's are
    x = (torch.randn(1, rows, 64),)
    program = torch.export.export(model, x, strict=True)
    fp16 = scheme == "fp16"
    graph = program.module() if fp16 else quantize(program, lambda m: m(*x), make_quantizer(QuantScheme.parse(scheme)))
    lowered = lower_to_pte({"forward": (graph, x)}, Soc.SM8650, fp16=fp16)
    (out,) = run_method(lowered.buffer, "forward", x)
    with torch.no_grad():
        ref = graph(*x)[0]
    sqnr = [10 * torch.log10(r.pow(2).mean() / (o - r).pow(2).mean()).item() for o, r in zip(out[0], ref)]
    assert min(sqnr) >= SOFTCAP_CASES[scheme, rows], [round(s, 1) for s in sqnr]


# Per form: (lowered SQNR floor, ceiling) in dB against eager on a [1, 16 rows, 2 heads, 32] input; measured 69.7 dB
# for the 3-D view StaticRMSNorm uses and 3.2 dB for rms_norm on the 4-D tensor itself.
RMSNORM_CASES = {"3-D view (StaticRMSNorm)": (65.0, None), "4-D as is": (None, 20.0)}


@pytest.mark.parametrize("form", list(RMSNORM_CASES))
def test_rmsnorm_on_4d_tensors_on_the_htp(qnn_sdk, form):
    """The q/k norms of a prefill normalise a [1, rows, heads, head_dim] tensor. QNN lowering (executorch 1.5.1)
    computes RmsNorm on such 4-D tensors over the wrong axis; StaticRMSNorm normalises a 3-D view instead
    (optimum_qnn/models/gemma4/modules.py). Both forms are lowered here: the view must match eager, and the 4-D form
    is checked to be still wrong, so that a fixed executorch shows the workaround can go."""
    import torch.nn.functional as F

    from optimum_qnn.models.gemma4.modules import StaticRMSNorm

    class Norm4d(nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

        def forward(self, x):
            return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)

    torch.manual_seed(0)
    weight = nn.Parameter(torch.rand(32) + 0.5)
    model = (StaticRMSNorm(weight, 1e-6) if form.startswith("3-D") else Norm4d(weight)).eval()
    x = (torch.randn(1, 16, 2, 32) * 3 + 0.5,)
    program = torch.export.export(model, x, strict=True)
    lowered = lower_to_pte({"forward": (program.module(), x)}, Soc.SM8650, fp16=True)
    assert not lowered.delegation["forward"].on_cpu  # the norm runs on the HTP
    (out,) = run_method(lowered.buffer, "forward", x)
    with torch.no_grad():
        ref = model(*x)
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean()).item()
    floor, ceiling = RMSNORM_CASES[form]
    assert floor is None or sqnr >= floor, f"{form}: {sqnr:.1f} dB"
    assert ceiling is None or sqnr <= ceiling, f"{form}: {sqnr:.1f} dB (executorch fixed 4-D RmsNorm? drop the 3-D view)"


def test_a_graph_qnn_will_not_compile_is_refused_with_what_qnn_said(qnn_sdk):
    """The HTP has no 8-bit ElementWiseMinimum: ExecuTorch's assertion on the empty context binary becomes a
    QnnCompileError naming the op QNN could not create (the window band used `minimum` until an 8a8w prefill graph
    failed on it; the same band as a `where` compiles)."""
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from optimum_qnn.errors import QnnCompileError
    from optimum_qnn.ops.mask import window_band

    band = window_band(8, 16, 3)

    class Band(nn.Module):
        def __init__(self, select: bool):
            super().__init__()
            self.select = select
            self.register_buffer("band", band)
            self.register_buffer("closed", band < 0)

        def forward(self, mask, scores):
            closed = torch.where(self.closed, self.band, mask) if self.select else torch.minimum(mask, self.band)
            return torch.softmax(scores + closed, -1)

    mask, scores = torch.zeros(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    mask[..., :4] = -255.0
    for select in (False, True):
        quantizer = QnnQuantizer(soc_model=QcomChipset.SM8650)
        quantizer.set_default_quant_config(QuantDtype.use_8a8w)
        prepared = prepare_pt2e(torch.export.export(Band(select), (mask, scores), strict=True).module(), quantizer)
        prepared(mask, scores)
        program = {"forward": torch.export.export(convert_pt2e(prepared), (mask, scores), strict=True)}
        if select:
            assert lower_to_pte(program, Soc.SM8650, fp16=False).delegation["forward"].fully_delegated
            continue
        with pytest.raises(QnnCompileError, match=r"refused a graph for SM8650 \(it could not create q::Minimum_u8"):
            lower_to_pte(program, Soc.SM8650, fp16=False)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="methods are converted side by side on Linux only")
def test_methods_converted_side_by_side_make_the_program_one_process_makes(qnn_sdk, monkeypatch, caplog):
    """`EdgeLowering` converts every method but the first in a forked child, which hands its edge program back
    (`program_transfer`): the lowering then makes the program converting both methods here makes (a PT2E-quantized
    pair: the QNN passes' encodings travel in the nodes' metadata), the child's weights come back as
    this process's own tensors, not copies, and a child that fails or dies is an error here."""
    from optimum_qnn.artifacts.inspection.pte import normalized_program
    from optimum_qnn.exporter import edge as edge_module
    from optimum_qnn.exporter.lowering import EdgeLowering

    _, x, converted = _quantized_mlp(8)
    methods = {"prefill_forward": (converted, (x,)), "kv_forward": (converted, (x * 2,))}

    def lowering(parallel: bool) -> EdgeLowering:
        monkeypatch.setattr(EdgeLowering, "parallel_edge", parallel)
        made = EdgeLowering(methods, fp16=False, constant_methods={"get_ar_len": 4})
        made.prepare()
        return made

    with caplog.at_level(logging.INFO, logger="optimum_qnn.progress"):
        side_by_side = lowering(True)
    steps = [r.getMessage() for r in caplog.records if r.name == "optimum_qnn.progress"]
    assert any("handing kv_forward to the export's process" in s for s in steps), steps  # it came from a child
    here = lowering(False)
    storages = {t.untyped_storage().data_ptr() for _, t in converted.state_dict().items()}
    storages |= {t.untyped_storage().data_ptr() for m in converted.modules() for t in vars(m).values()
                 if isinstance(t, torch.Tensor)}
    taken = side_by_side._edge.exported_program("kv_forward")
    weights = [t for t in [*taken.state_dict.values(), *taken.constants.values()] if t.numel() > 1]
    assert weights and all(t.untyped_storage().data_ptr() in storages for t in weights)
    for name in methods:  # the same graphs, node for node, with the same metadata keys
        a, b = (p._edge.exported_program(name).graph for p in (side_by_side, here))
        assert [(n.name, str(n.target), sorted(n.meta)) for n in a.nodes] == [
            (n.name, str(n.target), sorted(n.meta)) for n in b.nodes]
    # Each SoC lowered in a forked child (keep=True): QNN's counters here stay put, so the programs compare.
    assert normalized_program(side_by_side.lower(Soc.SM8650, weight_sharing=False).buffer) == normalized_program(
        here.lower(Soc.SM8650, weight_sharing=False).buffer)

    def fail(*args, **kwargs):
        raise ValueError("refused in the child")

    monkeypatch.setattr(EdgeLowering, "parallel_edge", True)
    with monkeypatch.context() as m:
        m.setattr(edge_module, "_convert_and_dump", fail)
        with pytest.raises(ValueError, match="refused in the child"):
            EdgeLowering(methods, fp16=False).prepare()
        m.setattr(edge_module, "_convert_and_dump", lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
        with pytest.raises(RuntimeError, match="edge conversion of kv_forward was killed by signal SIGKILL") as killed:
            EdgeLowering(methods, fp16=False).prepare()
        # the advice fits the work that was killed: convert one method at a time, not fewer SoCs
        assert "OPTIMUM_QNN_EDGE_SIDE_BY_SIDE=off" in str(killed.value) and "SoCs" not in str(killed.value)
