"""optimum_qnn.evaluation: windows, perplexity and SQNR, checked against Hugging Face's own loss (CPU only; the
exported side is checked end to end by the --evaluate run in test_export.py)."""

from __future__ import annotations

import math

import pytest
import torch

from optimum_qnn import StaticCausalLM
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.evaluation import score, windows
from tests.gemma4_tiny import tiny_config, tiny_model


def test_windows_start_with_bos_and_respect_the_budget():
    ids = list(range(10, 110))
    got = windows(ids, context_len=16, bos_id=2, max_tokens=40)
    assert all(w[0] == 2 and w.numel() <= 16 for w in got)
    assert sum(w.numel() - 1 for w in got) == 40
    assert torch.cat([w[1:] for w in got]).tolist() == ids[:40]  # consecutive, nothing skipped or repeated
    assert windows([5], 16, bos_id=None) == []


def test_perplexity_of_the_reference_equals_hugging_face_loss():
    model = tiny_model(tiny_config())
    static = StaticCausalLM.from_hf(model, max_context_len=32, ar_len=8)
    texts = windows(torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(0)).tolist(), 32, 2)
    scores = score(static.session(), static.session(), texts, progress=False)
    with torch.no_grad():
        nll = sum(model(w.unsqueeze(0), labels=w.unsqueeze(0)).loss.item() * (w.numel() - 1) for w in texts)
    assert scores.tokens == 70
    assert scores.perplexity_reference == pytest.approx(math.exp(nll / 70), rel=1e-4)
    assert scores.perplexity_exported == scores.perplexity_reference
    assert scores.sqnr_db == float("inf") and scores.top1_agreement == 1.0


def test_empty_evaluation_text_is_refused():
    model = tiny_model(tiny_config())
    static = StaticCausalLM.from_hf(model, max_context_len=32)
    with pytest.raises(InvalidInputError, match="fewer than 2 tokens"):
        score(static.session(), static.session(), [], progress=False)


def test_evaluate_refuses_weight_shared_hybrid_on_x86_before_loading(tmp_path, monkeypatch):
    import platform

    from optimum_qnn.config import ExportConfig, ExportMode
    from optimum_qnn.export import export

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    text = tmp_path / "eval.txt"
    text.write_text("some text")
    config = ExportConfig(mode=ExportMode.HYBRID, weight_sharing=True)
    with pytest.raises(InvalidInputError, match="add --no-weight-sharing"):
        export(tmp_path / "no-such-model", tmp_path / "out", config, evaluate=text)
    with pytest.raises(InvalidInputError, match="does not exist"):
        export(tmp_path / "no-such-model", tmp_path / "out", config, evaluate=tmp_path / "missing.txt")
