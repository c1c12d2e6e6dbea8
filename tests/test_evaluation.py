"""optimum_qnn.exporter.evaluation: windows, perplexity and SQNR, checked against Hugging Face's own loss (CPU only; the
exported side is checked end to end by the --evaluate run in test_export.py)."""

from __future__ import annotations

import math

import pytest
import torch

from optimum_qnn import StaticCausalLM
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.exporter.evaluation import score, windows
from tests.gemma4_tiny import tiny_config, tiny_model


def test_windows_start_with_bos_and_respect_the_budget():
    ids = list(range(10, 110))
    got = windows(ids, context_len=16, bos_id=2, max_tokens=40)
    assert all(w[0] == 2 and w.numel() <= 16 for w in got)
    assert sum(w.numel() - 1 for w in got) == 40
    assert torch.cat([w[1:] for w in got]).tolist() == ids[:40]  # consecutive, nothing skipped or repeated
    assert windows([5], 16, bos_id=None) == []


def test_scores_equal_hugging_face_loss_and_logits_of_both_models():
    """The "exported" side is a perturbed copy of the model (noise on every weight), so the two sides differ and
    each score is checked against its own independent computation: Hugging Face's loss for both perplexities,
    SQNR and top-1 agreement from Hugging Face's full-sequence logits."""
    import copy

    model = tiny_model(tiny_config())
    perturbed = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01 * p.std().clamp_min(1e-3))
    reference = StaticCausalLM.from_hf(model, max_context_len=32, ar_len=8)
    exported = StaticCausalLM.from_hf(perturbed, max_context_len=32, ar_len=8)
    texts = windows(torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(0)).tolist(), 32, 2)
    scores = score(reference.session(), exported.session(), texts, progress=False)

    def hf(m):
        with torch.no_grad():
            nll = sum(m(w.unsqueeze(0), labels=w.unsqueeze(0)).loss.item() * (w.numel() - 1) for w in texts)
            logits = [m(w.unsqueeze(0)).logits[0].double() for w in texts]
        return math.exp(nll / 70), logits

    ppl_ref, ref = hf(model)
    ppl_exp, got = hf(perturbed)
    assert scores.tokens == 70
    assert scores.perplexity_reference == pytest.approx(ppl_ref, rel=1e-4)
    assert scores.perplexity_exported == pytest.approx(ppl_exp, rel=1e-4)
    assert abs(ppl_exp - ppl_ref) > 1e-3 * ppl_ref  # the perturbation shows (10x the tolerance above)
    # SQNR over every row of every window; top-1 over the rows that predict a token of the text.
    all_ref, all_got = torch.cat(ref), torch.cat(got)
    expected_sqnr = 10 * math.log10(all_ref.pow(2).mean() / (all_got - all_ref).pow(2).mean())
    top1 = torch.cat([(r[:-1].argmax(-1) == g[:-1].argmax(-1)) for r, g in zip(ref, got)]).double().mean().item()
    print(f"perturbed model: SQNR {scores.sqnr_db:.3f} dB (HF {expected_sqnr:.3f}), top-1 {scores.top1_agreement:.3f}")
    assert scores.sqnr_db == pytest.approx(expected_sqnr, abs=0.01)
    assert scores.top1_agreement == top1 < 1.0


def test_empty_evaluation_text_is_refused():
    model = tiny_model(tiny_config())
    static = StaticCausalLM.from_hf(model, max_context_len=32)
    with pytest.raises(InvalidInputError, match="fewer than 2 tokens"):
        score(static.session(), static.session(), [], progress=False)


def test_evaluate_refuses_weight_shared_hybrid_on_x86_before_loading(tmp_path, monkeypatch):
    import platform

    from optimum_qnn.config import ExportConfig, ExportMode
    from optimum_qnn.exporter.pipeline import export

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    text = tmp_path / "eval.txt"
    text.write_text("some text")
    config = ExportConfig(mode=ExportMode.HYBRID, weight_sharing=True)
    with pytest.raises(InvalidInputError, match="add --no-weight-sharing"):
        export(tmp_path / "no-such-model", tmp_path / "out", config, evaluate=text)
    with pytest.raises(InvalidInputError, match="does not exist"):
        export(tmp_path / "no-such-model", tmp_path / "out", config, evaluate=tmp_path / "missing.txt")
