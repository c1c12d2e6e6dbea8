"""The TCM rule (optimum_qnn/exporter/htp_limits.py): a context whose cache tensor the HTP cannot tile is refused
before any work, naming the largest context that compiles; a compile refused on TCM says so, not 'another --quant'."""

from __future__ import annotations

import copy
import dataclasses
import json
import time

import pytest

from optimum_qnn.config import CacheLayout, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.exporter.htp_limits import check_tcm, choose_layout, largest_cache_tensor, qnn_refusal_message
from optimum_qnn.models.gemma4.modules import gemma4_layer_specs
from tests.conftest import run_main

# What QNN printed when Gemma-4-E2B's 32K prefill graph (16a4w_block, SM8650) failed, and the tiny probe's decode graph.
QNN_TCM_LINE = ("[ERROR] [Qnn ExecuTorch]: graph_prepare.cc:217::ERROR:Operator named q::*InputSlice (0x640500000002) "
                "not sufficiently tiled to fit in TCM. Requires 16777216 bytes")


def _e2b():
    from benchmarks.e2b_width import e2b_config

    cfg = e2b_config()
    return cfg, gemma4_layer_specs(cfg)


def _config(context: int, quant=QuantScheme.A16W8, layout=CacheLayout.FULL, socs=(Soc.SM8650,)) -> ExportConfig:
    return ExportConfig(socs=socs, quant=quant, mode=ExportMode.HYBRID,
                        shapes=ShapeConfig(context, 128, cache_layout=layout))


def test_probe_cases_follow_the_rule():
    """The measured cases of benchmarks/tcm_probe.json, each predicted by the rule: refused exactly when QNN refused
    (a 2-layer checkpoint whose probed layer has E2B's head_dim and one KV head, window 512)."""
    from pathlib import Path

    from transformers import Gemma4TextConfig

    rows = json.loads((Path(__file__).parents[1] / "benchmarks" / "tcm_probe.json").read_text())
    checked = 0
    for row in rows:
        head_dim, global_head_dim = {"sliding": (256, 32), "full": (32, 512), "both": (256, 512)}[row["kind"]]
        cfg = Gemma4TextConfig(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=row.get("kv_heads", 1), head_dim=head_dim, global_head_dim=global_head_dim,
            num_global_key_value_heads=row.get("kv_heads", 1), attention_k_eq_v=False,
            layer_types=["sliding_attention", "full_attention"], sliding_window=512, num_kv_shared_layers=0,
            hidden_size_per_layer_input=0, max_position_embeddings=max(row["context"], 8192),
        )
        mode = ExportMode.parse(row["mode"])
        config = ExportConfig(socs=(Soc.parse(row["soc"]),), quant=QuantScheme.parse(row["quant"]), mode=mode,
                              shapes=ShapeConfig(row["context"], 128, cache_layout=_probe_layout(row["extra"])),
                              weight_sharing=False, float_io="--float-io" in row["extra"])
        try:
            choose_layout(gemma4_layer_specs(cfg), 512, config)
            refused = False
        except InvalidInputError:
            refused = True
        assert refused == (row["tcm_bytes"] is not None), row
        assert row["exit"] == (2 if row["tcm_bytes"] else 0), row
        checked += 1
    assert checked >= 10


def _probe_layout(extra: list[str]) -> CacheLayout:
    return CacheLayout.parse(extra[extra.index("--cache-layout") + 1]) if "--cache-layout" in extra else CacheLayout.FULL


def test_e2b_at_32k_is_refused_naming_the_tensor_vtcm_and_largest_context():
    cfg, layers = _e2b()
    with pytest.raises(InvalidInputError) as e:
        check_tcm(layers, cfg.sliding_window, _config(32768, QuantScheme.A16W4_BLOCK))
    text = str(e.value)
    # The largest: a full-attention layer's K (one KV head, head_dim 512, 32768 columns, 2 bytes).
    assert "full-attention: 1 KV head(s) x head_dim 512 x 32768 columns, 33554432 bytes" in text
    assert "at most 8388608 bytes (8 MiB; SM8650 has 8 MiB of VTCM)" in text and "--float-io compiles longer" in text
    assert "--max-seq-len 8192 is the largest context that compiles for SM8650" in text
    check_tcm(layers, cfg.sliding_window, _config(8192, QuantScheme.A16W4_BLOCK))  # 8 MiB: what compiled
    check_tcm(layers, cfg.sliding_window, _config(32768, QuantScheme.FP16))  # fp16 compiled 16 MiB: no rule measured
    float_io = dataclasses.replace(_config(32768, QuantScheme.A16W4_BLOCK), float_io=True)
    check_tcm(layers, cfg.sliding_window, float_io)  # float32 caches at the boundary compiled 16 MiB
    # SA8797's VTCM is listed as 16 MB, yet it refused 12 MiB: the limit is 8 MiB there too.
    with pytest.raises(InvalidInputError, match="--max-seq-len 8192 is the largest context that compiles for SA8797"):
        check_tcm(layers, cfg.sliding_window, _config(16384, socs=(Soc.SA8797,)))


def test_ring_layout_takes_sliding_caches_out_of_the_limit():
    """A model whose largest caches are sliding (E2B's full layers cut to head_dim 256): the ring compiles what the
    full layout cannot, and the full layout's refusal says so."""
    from benchmarks.e2b_width import e2b_config

    cfg = e2b_config()
    layers = tuple(dataclasses.replace(l, head_dim=256 if l.attention.value == "full_attention" else 512)
                   for l in gemma4_layer_specs(cfg))  # sliding layers now hold the larger caches
    with pytest.raises(InvalidInputError, match=r"--max-seq-len 8192 is the largest .* \(with --cache-layout ring, 16384"):
        check_tcm(layers, 512, _config(32768))
    tensor = largest_cache_tensor(layers, 16384, (1, 128), 512, CacheLayout.RING, 2)
    assert tensor.layer.attention.value == "full_attention" and tensor.bytes == 256 * 16384 * 2
    check_tcm(layers, 512, _config(16384, layout=CacheLayout.RING))


def test_refused_compile_on_tcm_names_the_bytes_and_vtcm_not_another_quant():
    message = qnn_refusal_message(Soc.SM8650, "noise\n" + QNN_TCM_LINE + "\nmore")
    assert "q::*InputSlice needs a tensor of 16777216 bytes (16.0 MiB) in TCM" in message
    assert "SM8650 has 8 MiB (8388608 bytes) of VTCM (the largest measured to compile: 8388608 bytes)" in message
    assert "another --quant keeps the same cache" in message and "another --quant may compile" not in message
    other = qnn_refusal_message(Soc.SM8650, "could not create op: q::Minimum_u8")
    assert "another --quant may compile" in other


def test_export_refuses_before_loading(tmp_path, capsys):
    """`export` on a folder holding only E2B's config.json: the refusal comes from the preflight, in seconds, before
    any weight file is looked for."""
    cfg, _ = _e2b()
    cfg.save_pretrained(tmp_path / "e2b")
    start = time.monotonic()
    code, out, err = run_main(["export", "-m", tmp_path / "e2b", "-o", tmp_path / "out", "--max-seq-len", "32768",
                               "--quant", "16a4w_block", "--cache-layout", "full"], capsys)
    assert code != 0 and time.monotonic() - start < 60
    assert "--max-seq-len 32768 cannot compile for SM8650" in err and "8192 is the largest context" in err, err[-2000:]
    assert not (tmp_path / "out").exists()
    code, out, err = run_main(["export", "-m", tmp_path / "e2b", "-o", tmp_path / "out2", "--max-seq-len", "513",
                               "--cache-layout", "ring", "--quant", "fp16"], capsys)
    assert code != 0 and "not fewer than the 512 of a full-length cache" in err, err[-2000:]


def test_default_flags_at_32k_take_the_blocks_layout_for_e2b(caplog):
    """E2B at 32768 without --cache-layout: the full layout cannot compile (32 MiB caches), so the preflight takes the
    blocks layout, blocks of 8192 slots (8 MiB at head_dim 512, uint16), and says so in one line; the largest input is
    then a block or the prefill call's mask (128 x 32768 x 2 bytes = 8 MiB), both at the limit. --cache-layout full
    keeps the refusal. 65536 compiles in no layout: the mask alone is 16 MiB; the refusal names 32768."""
    cfg, layers = _e2b()
    auto = _config(32768, QuantScheme.A16W4_BLOCK, layout=None)
    with caplog.at_level("INFO", logger="optimum_qnn.stages"):
        chosen = choose_layout(layers, cfg.sliding_window, auto)
    assert chosen.shapes.cache_layout is CacheLayout.BLOCKS and chosen.shapes.cache_block_len == 8192
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Cache layout"))
    assert "blocks (caches cut into inputs of 8192 slots)" in line and "cannot compile in the full layout for SM8650" in line
    assert "ExecuTorch's C++ runner cannot run this variant (--cache-layout full forces its layout)" in line
    tensor = largest_cache_tensor(layers, 32768, (1, 128), cfg.sliding_window, CacheLayout.BLOCKS, 2, 8192)
    assert tensor.bytes == 8 * 2**20
    assert choose_layout(layers, cfg.sliding_window, _config(8192, QuantScheme.A16W4_BLOCK, layout=None)).shapes == \
        ShapeConfig(8192, 128, cache_layout=CacheLayout.FULL)  # the runner's layout wherever it compiles
    with pytest.raises(InvalidInputError, match="--max-seq-len 8192 is the largest context that compiles for SM8650"):
        choose_layout(layers, cfg.sliding_window, _config(32768, QuantScheme.A16W4_BLOCK))  # --cache-layout full
    from optimum_qnn.config import Lookahead

    lookahead = dataclasses.replace(auto, mode=ExportMode.LOOKAHEAD, lookahead=Lookahead(3, 2, 2))
    with pytest.raises(InvalidInputError, match="--max-seq-len 8192 is the largest"):  # lookahead keeps the full layout
        choose_layout(layers, cfg.sliding_window, lookahead)
    with pytest.raises(InvalidInputError, match=r"65536 cannot compile .*attention mask \(128 x 65536 .*"
                                                r"--max-seq-len 32768 is the largest context that compiles for SM8650"):
        choose_layout(layers, cfg.sliding_window, _config(65536, QuantScheme.A16W4_BLOCK, layout=None))


def test_export_with_default_flags_at_32k_says_it_takes_the_blocks_layout(tmp_path, capsys, caplog):
    """The command users type on a folder holding only E2B's config.json: the layout line comes from the preflight,
    then the missing weights stop it, in seconds."""
    cfg, _ = _e2b()
    cfg.save_pretrained(tmp_path / "e2b")
    with caplog.at_level("INFO", logger="optimum_qnn.stages"):
        code, out, err = run_main(["export", "-m", tmp_path / "e2b", "-o", tmp_path / "out", "--max-seq-len", "32768",
                                   "--quant", "16a4w_block"], capsys)
    assert "Cache layout: blocks (caches cut into inputs of 8192 slots)" in caplog.text, caplog.text[-2000:]
    assert code != 0 and "No *.safetensors weights" in err and "cannot compile for" not in err
    assert not (tmp_path / "out").exists()


def test_the_default_context_is_4096_unless_the_model_or_the_htp_allows_less(caplog):
    """No --max-seq-len: E2B gets DEFAULT_CONTEXT (4096, compiles: 4 MiB caches); a model whose max_position_embeddings
    is smaller gets that; a model whose uint16 caches at 4096 would not compile gets the largest that does; a
    prefill longer than the chosen context is refused naming --prefill-ar-len. One line says which and why."""
    from optimum_qnn.config import DEFAULT_CONTEXT
    from optimum_qnn.exporter.preflight import choose_context

    cfg, _ = _e2b()
    auto = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.A16W4_BLOCK, shapes=ShapeConfig(None, 128))
    with caplog.at_level("INFO", logger="optimum_qnn.stages"):
        assert choose_context(cfg, auto).shapes.max_seq_len == DEFAULT_CONTEXT == 4096
    assert "Context: 4096 tokens (the default (pass --max-seq-len for another))" in caplog.text
    short = copy.deepcopy(cfg)
    short.max_position_embeddings = 1024
    assert choose_context(short, auto).shapes.max_seq_len == 1024
    # Four KV heads of head_dim 512 (4 KiB a uint16 column): 8 MiB holds 2048 columns, so 2048 is chosen.
    from transformers import Gemma4TextConfig

    wide = Gemma4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=256, global_head_dim=512, attention_k_eq_v=False,
        layer_types=["sliding_attention", "full_attention"], sliding_window=512, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, max_position_embeddings=131072,
    )
    layers = gemma4_layer_specs(wide)
    assert max(l.kv_heads * l.head_dim for l in layers if l.owns_cache) == 2048
    chosen = choose_context(wide, auto)
    assert chosen.shapes.max_seq_len == 2048
    check_tcm(layers, wide.sliding_window, chosen)  # the chosen context passes the refusal it was chosen by
    with pytest.raises(InvalidInputError, match=r"--prefill-ar-len 1024 needs a longer context .* \(1024: the model's"):
        choose_context(short, dataclasses.replace(auto, shapes=ShapeConfig(None, 1024)))


def test_export_without_max_seq_len_says_its_context(random_model_dir, tmp_path, capsys):
    """The CLI's default reaches the preflight as 'choose' (None), not a number: a tiny model (max_position_embeddings
    512) is then refused for its prefill length with the flag to change, before any work."""
    rc, _, err = run_main(["export", "--model", random_model_dir, "--output", tmp_path / "out", "--prefill-ar-len", 512],
                          capsys)
    assert rc == 2
    assert "--prefill-ar-len 512 needs a longer context than this model allows (512: the model's max_position_embeddings)" in err
    assert not (tmp_path / "out").exists()


def test_a_block_length_that_cuts_the_methods_differently_is_refused():
    """--cache-layout blocks with a given block length: 8190 slots cut the decode call's 32767 into five blocks (the
    last of 7 slots) and the prefill call's 32640 into four; the graphs would differ, so the preflight refuses it."""
    from optimum_qnn.exporter.preflight import check_cache_layout

    cfg, _ = _e2b()
    shapes = ShapeConfig(32768, 128, cache_layout=CacheLayout.BLOCKS, cache_block_len=8190)
    config = dataclasses.replace(_config(32768, QuantScheme.A16W4_BLOCK), shapes=shapes)
    with pytest.raises(InvalidInputError, match=r"--cache-layout blocks: block_len 8190 cuts .* \(kv_forward: 5, prefill_forward: 4\)"):
        check_cache_layout(cfg, config)
    chosen = check_cache_layout(cfg, dataclasses.replace(config, shapes=dataclasses.replace(shapes, cache_block_len=None)))
    assert chosen.shapes.cache_block_len == 8192
