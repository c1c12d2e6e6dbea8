"""Loading only the text decoder of Gemma4 checkpoints from safetensors folders."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

from optimum_qnn.errors import UnsupportedModelError
from optimum_qnn.models.gemma4.loading import NON_TEXT_PREFIXES, CheckpointError, load_text_model
from tests.gemma4_tiny import tiny_config, tiny_model


@pytest.fixture(scope="module")
def multimodal_folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Gemma4Config(
        text_config=tiny_config(),
        vision_config=Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16),
        audio_config=Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=64, subsampling_conv_channels=[8, 4]),
    )
    model = Gemma4ForConditionalGeneration(cfg).eval()
    folder = tmp_path_factory.mktemp("mm")
    model.save_pretrained(folder)
    return folder, model


def test_multimodal_loads_text_only(multimodal_folder):
    folder, mm = multimodal_folder
    model, report = load_text_model(folder)
    tower_keys = [k for k in report.skipped if k.startswith(NON_TEXT_PREFIXES)]
    assert tower_keys, "the checkpoint holds tower weights"
    assert not any(k.startswith(NON_TEXT_PREFIXES) for k in report.read)
    assert not any("vision" in n or "audio" in n for n, _ in model.named_parameters())
    ids = torch.randint(3, 256, (1, 12))
    with torch.no_grad():
        ref = mm(input_ids=ids).logits
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_text_checkpoint_round_trip(tmp_path):
    src = tiny_model(tiny_config())
    src.save_pretrained(tmp_path)
    model, report = load_text_model(tmp_path)
    assert not report.skipped
    ids = torch.randint(3, 256, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, src(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_embedding_tables_can_stay_in_stored_dtype(tmp_path):
    """An exporter that quantizes the tables reads them in their stored dtype (bf16), everything else in fp32."""
    from optimum_qnn.models.gemma4.loading import EMBEDDING_TABLES

    tiny_model(tiny_config()).to(torch.bfloat16).save_pretrained(tmp_path)
    full, _ = load_text_model(tmp_path)
    kept, _ = load_text_model(tmp_path, tables_in_stored_dtype=True)
    params = dict(kept.named_parameters(remove_duplicate=False))
    assert {n for n, p in params.items() if p.dtype == torch.bfloat16} == set(EMBEDDING_TABLES) | {"lm_head.weight"}
    assert all(p.dtype == torch.float32 for n, p in params.items() if n not in EMBEDDING_TABLES and n != "lm_head.weight")
    for name, p in full.named_parameters():
        assert torch.equal(params[name].float(), p), name  # bf16 -> fp32 is exact


def test_missing_tensor_fails_loudly(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model(tiny_config()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="1 missing.*layers.1.mlp.up_proj"):
        load_text_model(tmp_path)


def test_unexpected_tensor_fails_loudly(tmp_path):
    """A text tensor the config's model has no place for (here: one layer past the last of the config) is refused,
    never silently dropped: it means the checkpoint and its config disagree."""
    from safetensors.torch import load_file, save_file

    tiny_model(tiny_config()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    n = tiny_config().num_hidden_layers
    sd[f"model.layers.{n}.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].clone()
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"0 missing.*1 unexpected.*model\.layers\.{n}\.mlp\.up_proj"):
        load_text_model(tmp_path)


def test_unknown_model_type_and_no_config(tmp_path):
    with pytest.raises(CheckpointError, match="No config.json"):
        load_text_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedModelError, match="'llama' is not supported; expected one of: gemma4"):
        load_text_model(tmp_path)


def test_pickle_only_refused(tmp_path):
    tiny_model(tiny_config()).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only pickle"):
        load_text_model(tmp_path)


def test_pickle_opt_in_loads_with_weights_only(tmp_path):
    src = tiny_model(tiny_config())
    src.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    model, _ = load_text_model(tmp_path, allow_pickle=True)
    ids = torch.randint(3, 256, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, src(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_remote_code_in_the_checkpoint_is_never_run(tmp_path):
    """A checkpoint whose config points at its own modeling code (``auto_map``, used with trust_remote_code) is
    loaded with the Gemma4 classes of transformers; the folder's Python file is never imported."""
    tiny_model(tiny_config()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "imported"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit('remote code ran')\n")
    model, _ = load_text_model(tmp_path)
    assert type(model).__name__ == "Gemma4ForCausalLM" and type(model).__module__.startswith("transformers.")
    assert not marker.exists()
