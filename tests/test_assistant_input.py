"""`--assistant` as a user gives it (issue 52): a drafter that does not fit the target, or is not a drafter, is refused
before any weight is read, naming both values and the fix; the CLI exits 2 and leaves no output folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.models.gemma4.loading import CheckpointError, load_assistant, read_text_config
from tests.gemma4_assistant_tiny import tiny_assistant, tiny_assistant_config
from tests.test_bad_input import refused

# An assistant builds on the hybrid mode (`tests.test_bad_input.cli` exports kv at context 32).
HYBRID = ("--mode", "hybrid", "--prefill-ar-len", "16", "--quant", "fp16")
FIX = "Pass the assistant trained for this target (e.g. google/gemma-4-e2b-it-assistant"


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fail the test if the export reaches the target's weights."""
    import optimum_qnn.exporter.pipeline as pipeline

    def boom(*args, **kwargs):
        raise AssertionError("the target's weights were read before --assistant was checked")

    monkeypatch.setattr(pipeline, "load_text_model", boom)


def _assistant_folder(tmp_path: Path, demo_model_dir: Path, **text_overrides) -> Path:
    """A config-only assistant folder for the demo target (the checks read config.json alone)."""
    backbone = text_overrides.pop("backbone_hidden_size", None)
    config = tiny_assistant_config(read_text_config(demo_model_dir), **text_overrides)
    if backbone is not None:
        config.backbone_hidden_size = backbone
    folder = tmp_path / "assistant"
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("overrides, match", [
    (dict(vocab_size=256), "vocabulary (text_config.vocab_size) is 256, the target's is 512"),
    (dict(backbone_hidden_size=64), "backbone_hidden_size (the target hidden size it reads) is 64, the target's is 128"),
    (dict(head_dim=16), "layer 0 (sliding_attention) (head_dim, KV heads) is (16, 2), the target's is (32, 2)"),
], ids=["vocabulary", "hidden-size", "head-dim"])
def test_an_assistant_of_another_target_is_refused_naming_both_values(
        overrides, match, demo_model_dir, tmp_path, capsys, no_weights_read):
    folder = _assistant_folder(tmp_path, demo_model_dir, **overrides)
    err = refused(capsys, demo_model_dir, tmp_path, "--assistant", folder, *HYBRID, match=match)
    assert f"The assistant {folder} does not fit the target {demo_model_dir}" in err and FIX in err


def test_a_target_checkpoint_as_assistant_is_refused(demo_model_dir, tmp_path, capsys, no_weights_read):
    err = refused(capsys, demo_model_dir, tmp_path, "--assistant", demo_model_dir, *HYBRID,
                  match="is not a Gemma 4 assistant (model_type 'gemma4_text'")
    assert "google/gemma-4-e2b-it-assistant" in err


@pytest.mark.parametrize("flags, match", [
    (["--draft-len", "3"], "--draft-len 3 sets how many tokens Gemma 4's assistant drafts a round; it needs --assistant"),
    (["--assistant", "A", "--mode", "kv"], "verify call of K + 1 tokens); not --mode kv: drop --mode"),
    (["--assistant", "A", "--mode", "lookahead", "--ngram", "2", "--window", "2", "--gcap", "2"],
     "verify call of K + 1 tokens); not --mode lookahead: drop --mode"),
    (["--assistant", "A", "--draft-len", "15"], "--draft-len 15 verifies 16 tokens a call, which must be fewer than "
                                                "--prefill-ar-len (16)"),
    (["--assistant", "A", "--draft-len", "0"], "--draft-len must be an integer >= 1; got 0"),
], ids=["draft-len-alone", "kv-mode", "lookahead-mode", "verify-past-prefill", "zero"])
def test_assistant_flags_that_cannot_work_are_refused_before_any_work(flags, match, demo_model_dir, tmp_path, capsys,
                                                                     no_weights_read):
    refused(capsys, demo_model_dir, tmp_path, *HYBRID, *flags, match=match)


def test_load_assistant_reads_every_tensor_and_refuses_a_missing_one(tmp_path, capsys):
    from transformers.utils import logging as hf_logging

    model = tiny_assistant(tiny_assistant_config(ordered=True), seed=4)
    model.save_pretrained(tmp_path / "a")
    capsys.readouterr()
    loaded = load_assistant(tmp_path / "a")
    # transformers' own "Loading weights" bar is not shown (the export prints its stage lines), and stays on after
    assert "Loading weights" not in capsys.readouterr().err and hf_logging.is_progress_bar_enabled()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "a" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["pre_projection.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"does not match the model of its config: 1 missing keys .*pre_projection"):
        load_assistant(tmp_path / "a")
    assert issubclass(CheckpointError, OptimumQnnError)
