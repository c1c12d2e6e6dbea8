"""optimum_qnn.models.gemma4.families: the Gemma 4 checkpoints users try, each answered from a tiny config before
any weight is read (the folders hold a weight file that is not safetensors: reading it would fail differently)."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimum_qnn.errors import UnsupportedModelError
from tests.gemma4_tiny import tiny_config


def _folder(tmp_path: Path, config) -> Path:
    folder = tmp_path / "model"
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")  # never opened by a refusal
    return folder


def _export(folder: Path, tmp_path: Path):
    from optimum_qnn.config import ExportConfig, ExportMode, QuantScheme, ShapeConfig
    from optimum_qnn.exporter.pipeline import export

    config = ExportConfig(quant=QuantScheme.FP16, mode=ExportMode.KV, shapes=ShapeConfig(32, 4))
    return export(folder, tmp_path / "out", config)


def _assistant_text_config():
    return tiny_config(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, use_double_wide_mlp=False,
                       num_kv_shared_layers=6)


def test_moe_26b_a4b_is_refused_before_any_weight(tmp_path):
    folder = _folder(tmp_path, tiny_config(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32))
    with pytest.raises(UnsupportedModelError, match=r"Mixture-of-Experts .*4 experts, 2 per token.*Gemma4TextRouter"):
        _export(folder, tmp_path)
    assert not (tmp_path / "out").exists()


def test_unified_12b_is_refused_naming_its_classes(tmp_path):
    from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedConfig

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    folder = _folder(tmp_path, Gemma4UnifiedConfig(text_config=text))
    with pytest.raises(UnsupportedModelError, match=r"unified checkpoint \(the 12B\).*Gemma4UnifiedTextDecoderLayer"):
        _export(folder, tmp_path)


@pytest.mark.parametrize("unified", [False, True], ids=["gemma4_assistant", "gemma4_unified_assistant"])
def test_assistant_mtp_drafter_is_refused_with_why(unified, tmp_path):
    if unified:
        from transformers.models.gemma4_unified_assistant.configuration_gemma4_unified_assistant import (
            Gemma4UnifiedAssistantConfig as Config,
        )
    else:
        from transformers.models.gemma4_assistant.configuration_gemma4_assistant import Gemma4AssistantConfig as Config
    folder = _folder(tmp_path, Config(text_config=_assistant_text_config().to_dict(), backbone_hidden_size=64))
    with pytest.raises(UnsupportedModelError, match=r"MTP drafter.*reuses the target model's K/V"):
        _export(folder, tmp_path)


def test_31b_dense_uses_the_supported_classes(tmp_path):
    """The 31B dense is `gemma4` without PLE, KV sharing, the double-wide MLP or the MoE block: its config is read with
    those traits off, and the static model of a tiny model with them (every module swapped) generates Hugging Face's
    greedy tokens."""
    import torch

    from optimum_qnn import StaticCausalLM
    from optimum_qnn.models.gemma4.loading import read_text_config
    from tests.gemma4_tiny import tiny_model

    config = tiny_config(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False)
    read = read_text_config(_folder(tmp_path, config))
    assert (read.hidden_size_per_layer_input, read.num_kv_shared_layers, read.use_double_wide_mlp) == (0, 0, False)
    assert not getattr(read, "enable_moe_block", False)
    model = tiny_model(read, seed=3)
    static = StaticCausalLM.from_hf(model, max_context_len=64, ar_len=8)
    prompt = torch.randint(3, read.vocab_size, (1, 11), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16, eos_token_id=None,
                             pad_token_id=0)
    assert static.generate(prompt, max_new_tokens=16).tolist() == ref.tolist()


def test_31b_sized_dense_is_refused_by_the_memory_estimate_before_any_weight(tmp_path):
    """At 31B widths the export's own memory estimate (config only, meta device) stops it on a host that cannot hold
    it. The widths are of the 31B's order (about 30 B parameters), not a copy of its published config."""
    from optimum_qnn.config import ExportConfig, ExportMode, QuantScheme, ShapeConfig
    from optimum_qnn.errors import OptimumQnnError
    from optimum_qnn.exporter.pipeline import export

    big = tiny_config(
        vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10, sliding_window=1024,
    )
    folder = _folder(tmp_path, big)
    config = ExportConfig(quant=QuantScheme.A16W4, mode=ExportMode.KV, shapes=ShapeConfig(64, 4), max_memory=20)
    with pytest.raises(OptimumQnnError, match=r"--max-memory"):
        export(folder, tmp_path / "out", config)
