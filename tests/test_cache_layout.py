"""The ring cache layout through the export's choices: the CLI option, the variant's name, the manifest's contract,
and ExecuTorch's C++ runner refusing it at load, by name."""

from __future__ import annotations

import argparse
import dataclasses
import types
from pathlib import Path

import pytest

from optimum_qnn.artifacts.manifest import contract_section
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
