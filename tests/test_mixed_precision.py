"""The 16a4w_e2b recipe: --size-budget parsing and planning, output-MSE weight ranges, and what the recipe buys."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from optimum_qnn.config import (
    ExportConfig,
    ExportMode,
    QuantScheme,
    ShapeConfig,
    SizeBudget,
    WeightRanges,
    recipe_fields,
)
from optimum_qnn.errors import InvalidInputError


# --- size budget ---------------------------------------------------------------------------------------------------


def test_size_budget_parses_share_and_gigabytes():
    assert SizeBudget.parse("25%") == SizeBudget(share=0.25)
    assert SizeBudget.parse(" 1.5GB") == SizeBudget(gigabytes=1.5)
    assert SizeBudget.parse("2") == SizeBudget(gigabytes=2.0)
    assert str(SizeBudget.parse("12.5%")) == "12.5%"


@pytest.mark.parametrize("text, match", [
    ("quarter", "expected a share of the linear weights kept at 8 bits such as '25%'"),
    ("0%", r"must lie in \(0%, 100%\]; got 0%; e.g. '25%'"),
    ("150%", "must lie in"),
    ("-1GB", "positive number of GB, e.g. '1.3GB'"),
    ("nan", "A size budget is one number"),
])
def test_bad_size_budgets_are_refused_with_what_to_do(text, match):
    with pytest.raises(InvalidInputError, match=match):
        SizeBudget.parse(text)


def test_gigabyte_budget_below_the_4bit_size_is_refused():
    params = 3 * 2**30  # 1.5 GB at 4 bits
    assert SizeBudget(gigabytes=2.0).upgradable(params, 4, 8) == 2**30  # 0.5 GB spare buys 1 G params at +4 bits
    with pytest.raises(InvalidInputError, match=r"take 1\.5 GB at 4 bits already; give at least that, or a share"):
        SizeBudget(gigabytes=1.0).upgradable(params, 4, 8)


def test_size_budget_needs_a_4bit_scheme():
    with pytest.raises(InvalidInputError, match="needs --quant 16a4w, 16a4w_block or a 4-bit recipe"):
        ExportConfig(quant=QuantScheme.A16W8, size_budget=SizeBudget(share=0.2))
    with pytest.raises(InvalidInputError, match="needs a 4-bit --quant"):
        ExportConfig(quant=QuantScheme.A16W8, weight_ranges=WeightRanges.OUTPUT_MSE)


def test_cli_maps_the_recipe_and_lets_options_override_it():
    import argparse

    from optimum_qnn.cli import add_export_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    base = ["--model", "m", "--output", "o"]
    config = config_from_args(parser.parse_args(base + ["--quant", "16a4w_e2b"]))
    assert config.quant is QuantScheme.A16W4_BLOCK and config.quant_tag == "16a4w_e2b"
    assert config.size_budget == SizeBudget(share=0.25) and config.weight_ranges is WeightRanges.OUTPUT_MSE
    config = config_from_args(parser.parse_args(base + ["--quant", "16a4w_e2b", "--size-budget", "10%"]))
    assert config.size_budget == SizeBudget(share=0.1) and config.recipe == "16a4w_e2b"
    config = config_from_args(parser.parse_args(base + ["--quant", "16a4w", "--size-budget", "0.5GB"]))
    assert config.size_budget == SizeBudget(gigabytes=0.5) and config.weight_ranges is WeightRanges.MINMAX
    with pytest.raises(InvalidInputError, match="Cannot parse --size-budget 'lots'"):
        config_from_args(parser.parse_args(base + ["--quant", "16a4w", "--size-budget", "lots"]))


# --- the plan ------------------------------------------------------------------------------------------------------


def test_plan_ranks_by_noise_per_parameter_within_the_budget():
    from optimum_qnn.quantization.mixed_precision import plan

    # big: the worst alone, but 10x the parameters; small1/small2 each cost more per parameter.
    sensitivity = {"big": 20.0, "small1": 25.0, "small2": 26.0, "quiet": 60.0}
    params = {"big": 1000, "small1": 50, "small2": 50, "quiet": 100}
    result = plan(sensitivity, params, SizeBudget(share=0.1))  # 120 of 1200 parameters
    assert result.kept == ("small1", "small2")
    assert [r.module for r in result.rows] == ["small1", "small2", "big", "quiet"]
    assert sum(r.params for r in result.rows if r.kept) <= 0.1 * sum(params.values())
    assert result.overrides() == ((r"^small1$", QuantScheme.A16W8), (r"^small2$", QuantScheme.A16W8))
    assert plan(sensitivity, params, SizeBudget(share=1.0)).kept_share == 1.0
    assert "2 of 4 linears (8.3% of their weights) kept at 16a8w" in result.table()


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.loud = nn.Linear(64, 64, bias=False)
        self.quiet = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            self.quiet.weight.mul_(1e-3)  # adds almost nothing to the output

    def forward(self, x):
        return self.loud(x) + self.quiet(x)


def test_sensitivity_measures_each_linear_alone_and_restores_it():
    from optimum_qnn.quantization.mixed_precision import htp_linears, measure_sensitivity
    from optimum_qnn.quantization.weight_search import fake_quantize_weight

    model = _TwoLinears()
    before = {n: p.clone() for n, p in model.named_parameters()}
    x = torch.randn(32, 64)
    sqnr = measure_sensitivity(htp_linears(model), lambda: model(x), lambda linear: 64)
    assert set(sqnr) == {"loud", "quiet"} and sqnr["loud"] + 40 < sqnr["quiet"]
    with torch.no_grad():
        ref = model(x)
    expected = ref - x @ (model.loud.weight - fake_quantize_weight(model.loud.weight, 4, 64)).T.detach()
    assert sqnr["loud"] == pytest.approx(10 * math.log10(ref.pow(2).mean() / (expected - ref).pow(2).mean()), abs=1e-3)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


class _Gained(_TwoLinears):
    """A trainable scale before the linears, as a norm's weight: its gradient must not be what the probes follow."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(64))

    def forward(self, x):
        return super().forward(x * self.gain)


def test_probe_sensitivity_estimates_the_exact_measure():
    from optimum_qnn.quantization.mixed_precision import htp_linears, measure_sensitivity, probe_sensitivity

    torch.manual_seed(0)
    model = _Gained()
    model.quiet.weight.requires_grad_(False)
    before = {n: p.clone() for n, p in model.named_parameters()}
    x = torch.randn(32, 64)
    exact = measure_sensitivity(htp_linears(model), lambda: model(x), lambda linear: 64)
    # The logits are linear in the weights here, so the first-order estimate is unbiased for the exact noise; its
    # relative spread over K probes is sqrt(2 / K): 5 % (0.2 dB) at 800.
    estimate = probe_sensitivity(model, htp_linears(model), lambda: model(x), lambda linear: 64, probes=800)
    assert set(estimate) == set(exact)
    for name in exact:
        assert estimate[name] == pytest.approx(exact[name], abs=0.5), (name, estimate, exact)
    # A different seed gives a different estimate (the probes are random), still close to the exact one.
    other = probe_sensitivity(model, htp_linears(model), lambda: model(x), lambda linear: 64, probes=800, seed=1)
    assert other != estimate and other["loud"] == pytest.approx(exact["loud"], abs=0.5)
    # Weights and their requires_grad flags are as they were; no gradient was accumulated into them.
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    assert model.loud.weight.requires_grad and model.gain.requires_grad and not model.quiet.weight.requires_grad


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(64, 64, bias=False)
        self.second = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def test_probes_keep_bf16_weights_as_stored():
    """With bf16 weights upcast in the graph (weights.UpcastLinear), the probes give what they give in fp32 and keep no
    fp32 copy of a weight for the backward passes; the linears' own forward is back afterwards."""
    from optimum_qnn.quantization.mixed_precision import htp_linears, probe_sensitivity
    from optimum_qnn.quantization.weights import UpcastLinear, upcast_in_graph

    torch.manual_seed(0)
    model = _Chain().to(torch.bfloat16)
    as_fp32 = _Chain()
    as_fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    upcast_in_graph(model)
    assert isinstance(model.second, UpcastLinear) and model.second.weight.dtype == torch.bfloat16
    x = torch.randn(32, 64)
    saved = []

    def run():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            return model(x)

    got = probe_sensitivity(model, htp_linears(model), run, lambda linear: 64, probes=64)
    want = probe_sensitivity(as_fp32, htp_linears(as_fp32), lambda: as_fp32(x), lambda linear: 64, probes=64)
    assert got == pytest.approx(want, abs=1e-3)
    # The second linear's backward keeps its weight as stored (bf16), not a float32 copy.
    assert any(t.dtype == torch.bfloat16 and t.shape == (64, 64) for t in saved)
    assert not any(t.dtype == torch.float32 and t.shape == (64, 64) for t in saved), [(t.dtype, t.shape) for t in saved]
    assert "forward" not in vars(model.second)
    assert torch.equal(model(x), model.second(torch.tanh(model.first(x))))


def test_input_rows_share_one_chunk_per_input_tensor():
    from optimum_qnn.quantization.weight_search import input_rows

    a, b, c = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(8, 2)
    x = torch.randn(3, 5, 16)

    def run():
        y = a(x)
        b(x)
        c(y)

    rows = input_rows({"a": a, "b": b, "c": c}, run)
    assert rows["a"][0] is rows["b"][0] and torch.equal(rows["a"][0], x.reshape(15, 16))
    assert rows["c"][0].shape == (15, 8) and len(rows["c"]) == 1
    assert not a._forward_pre_hooks and not c._forward_pre_hooks


def test_output_mse_clips_lower_the_output_error():
    from optimum_qnn.quantization.weight_search import CLIP_GRID, fake_quantize_weight, input_rows, output_mse_clips

    torch.manual_seed(0)
    linear = nn.Linear(128, 32, bias=False)
    with torch.no_grad():
        linear.weight[:, 0] *= 20  # one outlier input channel per row: min-max steps get coarse
    x = torch.randn(256, 128)
    rows = input_rows({"l": linear}, lambda: (linear(x[:100]), linear(x[100:])))["l"]
    assert [r.shape[0] for r in rows] == [100, 156] and torch.equal(torch.cat(rows), x)
    clips = output_mse_clips(linear, rows, 64)
    assert clips.min() < 1.0

    def error(clip):
        return float((x @ (fake_quantize_weight(linear.weight, 4, 64, clip) - linear.weight).T).pow(2).mean())

    # Chosen per channel, the clips beat min-max and every single factor of the grid applied to all channels.
    uniform = min(error(torch.full((32,), factor)) for factor in CLIP_GRID)
    assert error(clips) < error(None) and error(clips) <= uniform * (1 + 1e-5), (error(clips), uniform, error(None))


def test_apply_clips_scales_the_4bit_observers_only(qnn_sdk):
    from optimum_qnn.quantization.pt2e import convert, make_quantizer, prepare
    from optimum_qnn.quantization.weight_search import apply_clips

    model = _TwoLinears().eval()
    x = torch.randn(4, 64)
    program = torch.export.export(model, (x,), strict=True)
    quantizer = make_quantizer("16a4w_block", block_size=64, overrides={r"^quiet$": "16a8w"})
    graphs = []
    for clips in ({}, {"loud": torch.full((64,), 0.5), "quiet": torch.full((64,), 0.5)}):
        prepared = prepare(program, quantizer)
        prepared(x)
        assert apply_clips(prepared, clips) == (1 if clips else 0)  # quiet is 8-bit: left alone
        graphs.append(convert(prepared))

    def weight_scales(graph):
        return {n.target: getattr(graph, n.target) for n in graph.graph.nodes if n.op == "get_attr" and "scale" in n.target}

    plain, clipped = weight_scales(graphs[0]), weight_scales(graphs[1])
    # Two weights, two scale tensors: loud's (4-bit LPBQ: halved, still on the LPBQ grid) and quiet's (8-bit: same).
    assert len(plain) == 2, plain.keys()
    halved = [n for n in plain if torch.allclose(clipped[n], plain[n] * 0.5)]
    same = [n for n in plain if torch.equal(clipped[n], plain[n])]
    assert len(halved) == 1 and len(same) == 1, {n: (plain[n].shape, clipped[n].flatten()[:4] / plain[n].flatten()[:4]) for n in plain}


# --- manifest and model card ---------------------------------------------------------------------------------------


def test_plan_goes_into_the_manifest_and_model_card():
    from optimum_qnn.artifacts.model_card import _plan_section
    from optimum_qnn.artifacts.manifest import Quantization, _build
    from optimum_qnn.artifacts.sections import mixed_precision_section
    from optimum_qnn.quantization.mixed_precision import plan

    made = plan({"a": 20.0, "b": math.inf}, {"a": 10, "b": 10}, SizeBudget(share=0.5), probes=5)
    quantization = Quantization("16a4w_block", 64, "8,0", 16, [], named_recipe="16a4w_e2b", weight_ranges="output-mse",
                                mixed_precision=mixed_precision_section(made))
    data = json.loads(json.dumps(quantization, default=lambda o: o.__dict__))  # JSON has no inf: b is stored as 200
    back = _build(Quantization, data, "quantization")
    assert back == quantization and [r.kept for r in back.mixed_precision.linears] == [True, False]
    assert back.mixed_precision.linears[1].sqnr_db == 200.0
    card = _plan_section("qnn/sm8650/16a4w_e2b-ctx128-hybrid", back)
    assert "Recipe `16a4w_e2b`, weight ranges `output-mse`" in card and "| `a` | 10 | 20.0 | 16a8w |" in card
    # the number of probes is the one the plan used, read from the manifest, not a constant of the card
    assert back.mixed_precision.sensitivity_probes == 5 and "estimated from 5 random probes" in card
    unrecorded = dataclasses.replace(back, mixed_precision=dataclasses.replace(back.mixed_precision, sensitivity_probes=None))
    assert "their number was not recorded" in _plan_section("qnn/sm8650/16a4w_e2b-ctx128-hybrid", unrecorded)


# --- what the recipe buys on the demo model ------------------------------------------------------------------------


@pytest.mark.slow  # two PT2E quantizations of the demo model (no lowering): about 3 min on a loaded 2-core machine
def test_recipe_beats_plain_16a4w_block_on_the_demo_model(demo_model_dir, qnn_sdk):
    import dataclasses

    import tiny_gemma4  # on sys.path through the demo_model_dir fixture

    from optimum_qnn.config import EmbeddingQuant, Soc
    from optimum_qnn.exporter.evaluation import sqnr_db
    from optimum_qnn.exporter.residency import lm_head_in_float32, swap_embeddings_for_cpu
    from optimum_qnn.models.gemma4 import StaticCausalLM
    from optimum_qnn.models.gemma4.loading import load_text_model
    from optimum_qnn.exporter.preflight import load_tokenizer
    from optimum_qnn.quantization.ptq import quantize_static
    from optimum_qnn.session import KVSession, torch_method

    ctx, prefill = 64, 16
    hf = load_text_model(demo_model_dir)[0]
    tokenizer = load_tokenizer(demo_model_dir)
    paragraphs = tiny_gemma4.corpus().split("\n\n")
    held_out = torch.tensor([2] + tokenizer("\n\n".join(paragraphs[-20:]), add_special_tokens=False)["input_ids"][: ctx - 1])
    reference = StaticCausalLM.from_hf(hf, max_context_len=ctx, ar_len=prefill).session().feed(held_out)
    base = ExportConfig(socs=(Soc.SM8650,), mode=ExportMode.HYBRID, shapes=ShapeConfig(ctx, prefill),
                        embedding_quant=EmbeddingQuant(8, 0), weight_sharing=False, quant=QuantScheme.A16W4_BLOCK)
    scores = {}
    for name, config in {"plain": base, "recipe": dataclasses.replace(base, **recipe_fields("16a4w_e2b"))}.items():
        static = StaticCausalLM.from_hf(hf, max_context_len=ctx, ar_len=prefill, quantized=True)
        swap_embeddings_for_cpu(static, config)
        lm_head_in_float32(static)
        programs = {m.name: static.export(m.name) for m in static.contract.methods}
        graphs, _, mixed = quantize_static(static, programs, config, tokenizer, paragraphs[:8])
        assert (mixed is None) == (name == "plain")
        session = KVSession(static.contract, {n: torch_method(g) for n, g in graphs.items()})
        with torch.no_grad():
            scores[name] = sqnr_db(session.feed(held_out), reference)
    # Measured: about 23 dB plain, 32 dB with the recipe (1024 held-out tokens, context 128: 22.9 and 32.9).
    assert scores["recipe"] > scores["plain"] + 5, scores


@pytest.mark.slow  # one export with lowering of the tiny random model: about 3 min on the loaded 2-core machine
def test_recipe_export_records_its_plan(random_model_dir, tmp_path, qnn_sdk):
    """A real export with the recipe: the plan is in the manifest, the kept linears got 8-bit weights, the variant is
    named after the recipe and the model card shows the plan."""
    from optimum_qnn.config import EmbeddingQuant, Soc
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.artifacts.manifest import read_manifest

    config = ExportConfig(**recipe_fields("16a4w_e2b"), socs=(Soc.SM8650,), mode=ExportMode.KV,
                          shapes=ShapeConfig(32, 4), embedding_quant=EmbeddingQuant(8, 0))
    result = export(random_model_dir, tmp_path / "out", config)
    (variant,) = result.variants
    assert variant.name == "16a4w_e2b-ctx32-kv"
    quantization = read_manifest(variant).quantization
    plan = quantization.mixed_precision
    assert (quantization.scheme, quantization.named_recipe, quantization.weight_ranges) == ("16a4w_block", "16a4w_e2b", "output-mse")
    assert plan.size_budget == "25%" and 0 < plan.kept_share <= 0.25
    kept = {r.module for r in plan.linears if r.kept}
    assert kept == set(result.mixed_plan.kept) and kept
    # Every kept linear, and only those, has 8-bit weights in the quantization summary.
    eight_bit = [r for r in quantization.recipe if r.op == "linear" and r.weight.startswith("int8")]
    assert sum(r.count for r in eight_bit) == len(kept), eight_bit
    assert "## Mixed precision of `qnn/sm8650/16a4w_e2b-ctx32-kv`" in (tmp_path / "out" / "README.md").read_text()
