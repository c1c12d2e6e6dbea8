"""The ring cache layout through the export's choices: the CLI option, the variant's name, the manifest's contract,
and ExecuTorch's C++ runner refusing it at load, by name; then the variant index recording each variant's layout,
and `from_pretrained` choosing between the two layouts of one folder per backend."""

from __future__ import annotations

import argparse
import dataclasses
import types
from pathlib import Path

import pytest

from optimum_qnn.artifacts.sections import contract_section
from optimum_qnn.artifacts.writer import variant_name
from optimum_qnn.cli import add_export_arguments, config_from_args
from optimum_qnn.config import CacheLayout, ShapeConfig, Soc
from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD, RunnerContract
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.models.gemma4.modules import gemma4_layer_specs
from tests.gemma4_tiny import tiny_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    return parser


def _contract(layout: CacheLayout) -> RunnerContract:
    cfg = tiny_config()
    return RunnerContract.build(gemma4_layer_specs(cfg), vocab_size=cfg.vocab_size, context_len=64,
                                ar_lens={PREFILL_METHOD: 16, DECODE_METHOD: 1}, sliding_window=cfg.sliding_window,
                                cache_layout=layout)


def test_cli_option_reaches_the_config_and_the_variant_name() -> None:
    args = build_parser().parse_args(["-m", "x", "-o", "y", "--cache-layout", "ring", "--quant", "fp16", "--max-seq-len", "1024"])
    config = config_from_args(args)
    assert config.shapes.cache_layout is CacheLayout.RING
    assert variant_name(Soc.SM8650, config) == "qnn/sm8650/fp16-ctx1024-ring"
    full = dataclasses.replace(config, shapes=ShapeConfig(1024))
    assert variant_name(Soc.SM8650, full) == "qnn/sm8650/fp16-ctx1024"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-m", "x", "-o", "y", "--cache-layout", "rings"])
    with pytest.raises(InvalidInputError, match="cache_layout must be a CacheLayout"):
        ShapeConfig(cache_layout="ring")


def test_manifest_records_the_layout_and_reads_it_back() -> None:
    ring = _contract(CacheLayout.RING)
    section = contract_section(ring, weight_sharing=False)
    assert section.cache_layout == "ring" and "p % sliding_window" in section.kv_update
    back = RunnerContract.from_dict(dataclasses.asdict(section))
    assert back.cache_layout is CacheLayout.RING and back.ring_len == 8
    k0 = next(t for t in back.method(DECODE_METHOD).inputs if t.name == "k_cache_0")  # layer 0 slides
    k2 = next(t for t in back.method(DECODE_METHOD).inputs if t.name == "k_cache_2")  # layer 2 is full
    assert k0.shape[-1] == 8 and k2.shape[-1] == 63
    assert back.method(PREFILL_METHOD).inputs[2].shape == (1, 1, 16, 8 + 16)
    # A manifest written before the layout existed has no field: its caches are full-length.
    old = {k: v for k, v in dataclasses.asdict(contract_section(_contract(CacheLayout.FULL), weight_sharing=False)).items()
           if k != "cache_layout"}
    assert RunnerContract.from_dict(old).cache_layout is CacheLayout.FULL


def test_cpp_runner_refuses_a_ring_variant_by_name(tmp_path: Path) -> None:
    from optimum_qnn.runtime.backends.runner import RunnerBackend, check_runner_layout

    check_runner_layout(tmp_path / "fp16-ctx64", _contract(CacheLayout.FULL))  # the runner's own layout passes
    manifest = types.SimpleNamespace(runner_contract=lambda: _contract(CacheLayout.RING))
    with pytest.raises(InvalidInputError, match=r"Variant fp16-ctx64-ring has the 'ring' cache layout .* 8 slots.*qnn_llama_runner"):
        RunnerBackend(tmp_path, tmp_path / "fp16-ctx64-ring", manifest, device="runner")


@pytest.mark.parametrize("device", ["runner", "adb"])
def test_runner_backends_refuse_a_blocks_variant_by_name(tmp_path: Path, device: str) -> None:
    from optimum_qnn.runtime.backends.runner import RunnerBackend

    cfg = tiny_config()
    blocks = RunnerContract.build(gemma4_layer_specs(cfg), vocab_size=cfg.vocab_size, context_len=64,
                                  ar_lens={PREFILL_METHOD: 16, DECODE_METHOD: 1}, sliding_window=cfg.sliding_window,
                                  cache_layout=CacheLayout.BLOCKS, block_len=32)
    manifest = types.SimpleNamespace(runner_contract=lambda: blocks)
    with pytest.raises(InvalidInputError, match=r"Variant fp16-ctx64-blocks has the 'blocks' cache layout \(each long "
                                                r"cache is cut into inputs of 32 slots\).*qnn_llama_runner"):
        RunnerBackend(tmp_path, tmp_path / "fp16-ctx64-blocks", manifest, device=device)


# --- choosing between the layouts of one artifact folder (tests/conftest.py `layouts_export`) ----------------------


def test_the_index_records_each_variants_layout_and_an_old_index_reads_as_full(layouts_export: Path) -> None:
    from optimum_qnn.artifacts.variants import VariantNotFoundError, entry_layout, select_variant
    from optimum_qnn.artifacts.writer import read_index

    index = read_index(layouts_export)
    assert {v["path"]: v["cache_layout"] for v in index["variants"]} == {
        "qnn/sm8650/fp16-ctx64-kv": "full", "qnn/sm8650/fp16-ctx128-kv": "full", "qnn/sm8650/fp16-ctx128-ring-kv": "ring",
    }
    for layout in ("full", "ring"):
        picked = select_variant(index, "SM8650", "fp16", 128, layout)
        assert entry_layout(picked) == layout and picked["path"].endswith("-ring-kv") == (layout == "ring")
    # Each backend's preference, when the request names no layout.
    assert select_variant(index, "SM8650", "fp16", 128, prefer_layout="ring")["path"] == "qnn/sm8650/fp16-ctx128-ring-kv"
    assert select_variant(index, "SM8650", "fp16", 128, prefer_layout="full")["path"] == "qnn/sm8650/fp16-ctx128-kv"
    with pytest.raises(VariantNotFoundError, match=r"No variant for .*cache_layout=ring; available: .*ctx128/kv/ring"):
        select_variant(index, "SM8650", "fp16", 64, "ring")
    # An index written before the layout was recorded: no field, every variant full.
    old = {**index, "variants": [{k: v for k, v in e.items() if k != "cache_layout"} for e in index["variants"]
                                 if "-ring" not in e["path"]]}
    assert entry_layout(old["variants"][0]) == "full"
    assert select_variant(old, "SM8650", "fp16", 128, prefer_layout="ring")["path"] == "qnn/sm8650/fp16-ctx128-kv"
    assert select_variant(old, "SM8650", "fp16", 128, "full")["path"] == "qnn/sm8650/fp16-ctx128-kv"


def test_from_pretrained_takes_the_ring_on_the_host_and_the_full_layout_on_a_runner(layouts_export: Path,
                                                                                    monkeypatch) -> None:
    from optimum_qnn.runtime.backends import runner
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    ring = QNNModelForCausalLM.from_pretrained(layouts_export, context_len=128)
    assert ring.variant.name == "fp16-ctx128-ring-kv" and ring.contract.cache_layout is CacheLayout.RING
    full = QNNModelForCausalLM.from_pretrained(layouts_export, context_len=128, cache_layout="full")
    assert full.variant.name == "fp16-ctx128-kv" and full.contract.cache_layout is CacheLayout.FULL
    ort = QNNModelForCausalLM.from_pretrained(layouts_export, context_len=128, device="host:onnxruntime")
    assert ort.variant.name == "fp16-ctx128-ring-kv"
    # The same greedy tokens from both layouts, past the window of 7 (a 20-token prompt, 8 new tokens).
    prompt = list(range(5, 25))
    tokens = [m.generate(prompt, max_new_tokens=8, eos_token_id=[])[0, 20:].tolist() for m in (ring, full, ort)]
    assert len(tokens[0]) == 8 and tokens[0] == tokens[1] == tokens[2], tokens

    chosen = []

    class Recorder:  # stands in for ExecuTorch's C++ runner: only the variant it was handed matters here
        def __init__(self, root, variant, manifest, **options):
            runner.check_runner_layout(variant, manifest.runner_contract())
            chosen.append(variant.name)

    monkeypatch.setattr(runner, "RunnerBackend", Recorder)
    QNNModelForCausalLM.from_pretrained(layouts_export, context_len=128, device="runner")
    assert chosen == ["fp16-ctx128-kv"]
    with pytest.raises(InvalidInputError, match=r"Variant fp16-ctx128-ring-kv has the 'ring' cache layout"):
        QNNModelForCausalLM.from_pretrained(layouts_export, context_len=128, cache_layout="ring", device="runner")
    with pytest.raises(InvalidInputError, match=r"cache_layout must be 'full', 'ring' or 'blocks'"):
        QNNModelForCausalLM.from_pretrained(layouts_export, cache_layout="rings")
