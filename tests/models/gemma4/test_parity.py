"""The static Gemma4 model against Hugging Face eager with its own cache: prefill, decode, generate."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from optimum_qnn import StaticCausalLM
from tests.gemma4_tiny import CONFIGS, tiny_config, tiny_model

CTX = 48


def hf_step_logits(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Hugging Face logits: prefill of the prompt, then one token per call, with its own DynamicCache."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids[:, :prompt_len], past_key_values=cache, use_cache=True)
        logits = [out.logits[0]]
        for t in range(prompt_len, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[0])
    return torch.cat(logits)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("ar_len", [1, 4])
@pytest.mark.parametrize("prompt_len", [5, 13])
@pytest.mark.parametrize("quantized", [False, True], ids=["float-graph", "graph-for-quantization"])
def test_prefill_decode_parity(name: str, ar_len: int, prompt_len: int, quantized: bool) -> None:
    cfg = tiny_config(**CONFIGS[name])
    model = tiny_model(cfg)
    static = StaticCausalLM.from_hf(model, max_context_len=CTX, ar_len=ar_len, quantized=quantized)
    window = cfg.sliding_window
    total = prompt_len + 2 * window + 2  # decode well past the sliding window
    ids = torch.randint(3, cfg.vocab_size, (1, total), generator=torch.Generator().manual_seed(1))
    expected = hf_step_logits(model, ids, prompt_len)
    session = static.session()
    got = torch.cat([session.feed(ids[0, :prompt_len])] + [session.feed(ids[0, t : t + 1]) for t in range(prompt_len, total)])
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-4, f"max |logit diff| {diff:.3g} at config {name}"
    assert expected.abs().max() > 1.0  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("name", ["all_traits", "no_ple_no_share_kv"])
def test_generate_matches_hf(name: str) -> None:
    cfg = tiny_config(**CONFIGS[name])
    model = tiny_model(cfg, seed=3)
    static = StaticCausalLM.from_hf(model, max_context_len=64, ar_len=8)
    for prompt_len in (4, 19):
        prompt = torch.randint(3, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
        with torch.no_grad():
            ref = model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32, eos_token_id=None, pad_token_id=0)
        got = static.generate(prompt, max_new_tokens=32)
        assert got.tolist() == ref.tolist()


def test_context_filled_to_the_last_slot():
    """Prefill chunks that end exactly at C, and a decode at position C - 1, still match Hugging Face."""
    cfg = tiny_config()
    model = tiny_model(cfg)
    ctx = 32
    static = StaticCausalLM.from_hf(model, max_context_len=ctx, ar_len=8)
    ids = torch.randint(3, cfg.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids).logits[0]
    by_prefill = static.session().feed_method("prefill_forward", ids[0])
    session = static.session()
    by_mix = torch.cat([session.feed(ids[0, : ctx - 1]), session.feed(ids[0, ctx - 1 :])])
    for got in (by_prefill, by_mix):
        assert (got - expected).abs().max().item() <= 1e-4
