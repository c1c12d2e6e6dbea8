"""QNNModelForCausalLM on the x86 emulator: streaming, sampling, stats, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from optimum_qnn.errors import ContextOverflowError, InvalidInputError, OptimumQnnError
from optimum_qnn.manifest import ManifestError
from optimum_qnn.modeling import QNNModelForCausalLM, VariantNotFoundError
from tests.conftest import FP16_CTX


class Collect:
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, t):
        self.tokens += t.tolist()

    def end(self):
        self.ended = True


def test_streamer_sampling_and_stats(fp16_model):
    prompt = torch.tensor([2, 40, 41, 42])
    streamer = Collect()
    out = fp16_model.generate(prompt, max_new_tokens=8, streamer=streamer, eos_token_id=[])
    assert streamer.ended and streamer.tokens == out[0, 4:].tolist()
    s = fp16_model.stats
    assert s.new_tokens == 8 and s.stopped_by == "max_new_tokens"
    assert s.time_to_first_token_s > 0 and s.decode_tokens_per_s > 0 and 0 <= s.host_overhead_share < 1
    runs = [
        fp16_model.generate(prompt, max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, top_p=0.9,
                            eos_token_id=[], generator=torch.Generator().manual_seed(7)).tolist()
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_kv_mode_greedy_matches_hf_for_32_tokens(demo_kv_export, demo_model_dir):
    """A kv-mode export (decode method only) of the demo Gemma4 (window 16): prompts shorter and longer than the
    window, 32 new tokens each, identical to Hugging Face `generate`."""
    from transformers import AutoTokenizer

    from optimum_qnn.models.gemma4.loading import load_text_model

    hf = load_text_model(demo_model_dir)[0]
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    model = QNNModelForCausalLM.from_pretrained(demo_kv_export)
    assert [m.name for m in model.contract.methods] == ["kv_forward"]
    texts = ["The for statement", "Assignment statements are used to (re)bind names to values and to modify attributes"]
    prompts = [torch.tensor([2] + tok(t)["input_ids"]) for t in texts]
    assert len(prompts[0]) < 16 < len(prompts[1])
    for prompt in prompts:
        with torch.no_grad():
            ref = hf.generate(prompt.unsqueeze(0), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert model.generate(prompt, max_new_tokens=32, eos_token_id=[]).tolist() == ref.tolist(), len(prompt)


def test_bad_input(fp16_model):
    with pytest.raises(InvalidInputError, match="empty"):
        fp16_model.generate(torch.tensor([], dtype=torch.long))
    with pytest.raises(ContextOverflowError, match=f"exported context holds {FP16_CTX}"):
        fp16_model.generate(torch.full((FP16_CTX + 1,), 5))
    with pytest.raises(InvalidInputError, match=r"Token ids must lie in \[0, 512\)"):
        fp16_model.generate(torch.tensor([2, 600]))


def test_generation_stops_at_the_context_end(fp16_model):
    prompt = torch.full((FP16_CTX - 3,), 7)
    out = fp16_model.generate(prompt, max_new_tokens=10, eos_token_id=[])
    assert out.shape[1] == (FP16_CTX - 3) + 4  # 3 free slots, plus the last token, which needs none
    assert fp16_model.stats.stopped_by == "context_full"


def test_variant_selection_errors(fp16_export):
    with pytest.raises(VariantNotFoundError, match="available: SM8650/fp16/ctx96/hybrid"):
        QNNModelForCausalLM.from_pretrained(fp16_export.output, soc="SM8750")


@pytest.fixture()
def artifact_copy(fp16_export, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(fp16_export.output, dst)
    return dst, dst / fp16_export.variants[0].relative_to(fp16_export.output)


def test_tampered_program_fails_the_sha256_check(artifact_copy):
    root, variant = artifact_copy
    data = bytearray((variant / "model.pte").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (variant / "model.pte").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="model.pte does not match its manifest sha256"):
        QNNModelForCausalLM.from_pretrained(root)


def test_truncated_program_with_matching_manifest_is_refused_cleanly(artifact_copy):
    from optimum_qnn.manifest import file_entry, read_manifest

    root, variant = artifact_copy
    pte = variant / "model.pte"
    pte.write_bytes(pte.read_bytes()[:4096])
    m = read_manifest(variant)
    entry = file_entry(variant, "model.pte")
    d = json.loads(m.to_json())
    d["program"] = d["files"][0] = {"path": entry.path, "size": entry.size, "sha256": entry.sha256}
    (variant / "manifest.json").write_text(json.dumps(d))
    index = json.loads((root / "qnn_index.json").read_text())
    with pytest.raises(OptimumQnnError, match="corrupt or not an ExecuTorch program"):
        QNNModelForCausalLM.from_pretrained(root)
    assert index  # the index was not touched
