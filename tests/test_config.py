"""Export configuration and CLI argument mapping: bad values name the allowed ones."""

from __future__ import annotations

import argparse

import pytest

from optimum_qnn.cli import add_export_arguments, config_from_args
from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
from optimum_qnn.errors import InvalidInputError


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    return config_from_args(parser.parse_args(["--model", "m", "--output", "o", *argv]))


def test_defaults_and_mapping():
    config = parse("--soc", "sm8750", "SM8550", "--quant", "16a8w", "--quant-override", "lm_head=16a16w", "--embedding-quant", "8,0")
    assert config.socs == (Soc.SM8750, Soc.SM8550)
    assert config.quant is QuantScheme.A16W8 and config.overrides == (("lm_head", QuantScheme.A16W16),)
    assert config.embedding_quant == EmbeddingQuant(8, 0)
    default = parse()
    assert default.mode is ExportMode.HYBRID and default.quant_tag == "16a8w"
    assert default.shapes == ShapeConfig(None, 128)  # None: the exporter chooses (DEFAULT_CONTEXT, or less)


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--soc", "SM9999"), "Unknown SoC 'SM9999'; expected one of: SA8295, SA8797, SC8380XP, SM8350"),
        (("--quant", "3a3w"), "Unknown quant scheme '3a3w'; expected one of: fp16, 16a16w"),
        (("--max-seq-len", "64", "--prefill-ar-len", "64"), r"prefill_ar_len \(64\) must be smaller than max_seq_len \(64\)"),
        (("--max-seq-len", "0"), "must be positive"),
        (("--embedding-quant", "3,32"), "bits must be one of 0, 4, 8"),
        (("--quant-override", "lm_head"), "expected REGEX=SCHEME"),
        (("--quant", "fp16", "--quant-override", "lm_head=16a8w"), "need a quantized --quant scheme"),
        (("--shards", "0"), "shards must be at least 1; got 0"),
    ],
)
def test_bad_values(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_kv_mode_ignores_prefill_length():
    assert parse("--mode", "kv", "--max-seq-len", "64").mode is ExportMode.KV
    with pytest.raises(ValueError, match="At least one SoC"):
        ExportConfig(socs=())


def test_shards_leave_each_shard_a_layer():
    parse("--shards", "7").check_shards(7)
    parse().check_shards(7)  # the exporter chooses
    with pytest.raises(ValueError, match="--shards 8 exceeds the model's 7 decoder layers"):
        parse("--shards", "8").check_shards(7)


def test_embedding_quant_default_fits_the_table_widths():
    """Not chosen by the user: 4-bit in groups of 32, or of 16/8 when 32 does not divide a table's width (a Gemma4
    48 wide is valid), one group per row when neither does, 8-bit per row when a width is odd; float for fp16."""
    assert parse().embedding_quant is None and parse("--embedding-quant", "4,32").embedding_quant == EmbeddingQuant(4, 32)
    default = EmbeddingQuant.default_for
    assert default(QuantScheme.A16W4_BLOCK, (1536, 35 * 256)) == EmbeddingQuant(4, 32)  # Gemma-4-E2B
    assert default(QuantScheme.A16W8, (48, 6 * 8)) == EmbeddingQuant(4, 16)
    assert default(QuantScheme.A16W8, (40,)) == EmbeddingQuant(4, 8)
    assert default(QuantScheme.A16W8, (36,)) == EmbeddingQuant(4, 0)
    assert default(QuantScheme.A16W8, (64, 49)) == EmbeddingQuant(8, 0)
    assert default(QuantScheme.FP16, (48,)) == EmbeddingQuant(0, 0)
    for quant in QuantScheme:
        for widths in [(48, 48), (40,), (36,), (64, 49), (128, 96)]:
            default(quant, widths).check_widths(widths)  # the default always fits
    with pytest.raises(ValueError, match="48 wide, not a multiple of the group size 32; choose a group size of 16,"):
        EmbeddingQuant(4, 32).check_widths((48, 48))


@pytest.mark.parametrize(("text", "expected"), [
    ("4,32", EmbeddingQuant(4, 32)), ("4,32,asym", EmbeddingQuant(4, 32, symmetric=False)),
    ("8", EmbeddingQuant(8, 0)), ("8,asym", EmbeddingQuant(8, 0, symmetric=False)), ("4,64,sym", EmbeddingQuant(4, 64)),
    ("none", EmbeddingQuant(0, 0)),
])
def test_embedding_quant_parse_round_trips(text, expected):
    """Symmetric (fp16 scales, no zero points) unless ',asym' asks for zero points; str() gives the parsable form."""
    parsed = EmbeddingQuant.parse(text)
    assert parsed == expected and EmbeddingQuant.parse(str(parsed)) == parsed
    assert expected.symmetric or str(parsed).endswith(",asym")


def test_embedding_quant_parse_refuses_junk():
    for text in ("4,32,asymm", "asym", "4,32,1,asym"):
        with pytest.raises(ValueError, match="Cannot parse embedding quantization"):
            EmbeddingQuant.parse(text)


def test_shards_and_max_memory_default_to_the_exporters_choice():
    default = parse()
    assert default.shards is None and default.max_memory is None
    config = parse("--max-memory", "12.5", "--shards", "4")
    assert config.max_memory == 12.5 and config.shards == 4


@pytest.mark.parametrize("value", ["0", "-2", "lots", "nan", "inf", ""])
def test_max_memory_bad_values_are_refused(value):
    with pytest.raises(InvalidInputError, match=f"--max-memory must be a positive number of GB, e.g. 16 or 7.5; got '{value}'"):
        parse("--max-memory", value)


def test_check_weight_sharing_flag_reaches_the_export(monkeypatch, tmp_path):
    """`--check-weight-sharing` runs the shared-vs-unshared inspection of `export(check_weight_sharing=True)`."""
    import optimum_qnn.exporter.pipeline as export_module
    from optimum_qnn.cli import run_export

    seen = {}

    class Stop(Exception):
        pass

    def fake_export(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(export_module, "export", fake_export)
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    for argv, expected in ((["--check-weight-sharing"], True), ([], False)):
        args = parser.parse_args(["--model", str(tmp_path), "--output", str(tmp_path / "o"), "--quant", "fp16", *argv])
        with pytest.raises(Stop):
            run_export(args)
        assert seen["check_weight_sharing"] is expected


def test_export_help_says_what_the_code_does():
    """The recipe's plan runs at Gemma-4-E2B's size (benchmarks/e2b_full.json "16a4w_e2b:auto"), and shards compile in
    worker processes (exporter/parallel_compile.py), not one at a time."""
    from optimum_qnn.exporter import parallel_compile

    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "does not fit" not in text and "one at a time" not in text
    assert "compiled in worker processes (up to one per core" in text
    assert parallel_compile.default_workers.__doc__.startswith("The cores this process may run on")
