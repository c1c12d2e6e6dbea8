"""The ring cache layout (sliding layers keep only their window) against Hugging Face and the full layout.

Window 8, prompts of 3x the window and more, prefill chunks of 4 (shorter than the window) and 16 (longer: the graph's
window band then spans the ring's columns), decode far past the window: every logit within 1e-4 of Hugging Face's
eager model, and greedy tokens equal to the full-length layout's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optimum_qnn import StaticCausalLM
from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD, AttentionKind, CacheLayout, RunnerContract
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.models.gemma4.modules import gemma4_layer_specs
from tests.gemma4_tiny import CONFIGS, tiny_config, tiny_model
from tests.models.gemma4.test_parity import hf_step_logits

CTX = 96


@pytest.mark.parametrize("name", ["all_traits", "no_ple_no_share_kv"])
@pytest.mark.parametrize("ar_len", [4, 16])
def test_ring_matches_hf_past_the_window(name: str, ar_len: int) -> None:
    cfg = tiny_config(**CONFIGS[name])
    model = tiny_model(cfg)
    window = cfg.sliding_window
    static = StaticCausalLM.from_hf(model, max_context_len=CTX, ar_len=ar_len, cache_layout=CacheLayout.RING)
    assert static.contract.ring_len == window
    prompt_len = 3 * window + 5  # several prefill chunks; the prompt alone wraps the ring three times
    total = prompt_len + 2 * window + 3
    ids = torch.randint(3, cfg.vocab_size, (1, total), generator=torch.Generator().manual_seed(7))
    expected = hf_step_logits(model, ids, prompt_len)
    session = static.session()
    got = torch.cat([session.feed(ids[0, :prompt_len])] + [session.feed(ids[0, t : t + 1]) for t in range(prompt_len, total)])
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-4, f"max |logit diff| {diff:.3g}"
    assert expected.abs().max() > 1.0


@pytest.mark.parametrize("ar_len", [4, 16])
def test_ring_greedy_equals_full_layout(ar_len: int) -> None:
    cfg = tiny_config()
    model = tiny_model(cfg, seed=3)
    prompt = torch.randint(3, cfg.vocab_size, (1, 3 * cfg.sliding_window + 2), generator=torch.Generator().manual_seed(2))
    full = StaticCausalLM.from_hf(model, max_context_len=CTX, ar_len=ar_len).generate(prompt, max_new_tokens=40)
    ring = StaticCausalLM.from_hf(model, max_context_len=CTX, ar_len=ar_len, cache_layout="ring").generate(prompt, max_new_tokens=40)
    assert ring.shape[1] == prompt.shape[1] + 40
    assert ring.tolist() == full.tolist()


def test_ring_truncate_reads_the_kept_tokens_again() -> None:
    """Keeping a prefix after the ring has overwritten its window gives the logits of a fresh session."""
    cfg = tiny_config()
    static = StaticCausalLM.from_hf(tiny_model(cfg), max_context_len=CTX, ar_len=4, cache_layout=CacheLayout.RING)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 50)
    expected = static.session().feed(ids)
    session = static.session()
    session.feed(ids)
    for keep in (49, 20):  # 49: the ring still holds its window; 20: overwritten 30 tokens ago
        session.truncate(keep)
        assert session.n_past == keep
        got = session.feed(ids[keep:])
        assert np.abs(got - expected[keep:]).max() <= 1e-5


def test_ring_kv_bytes_per_decode_call() -> None:
    """At Gemma-4-E2B's layout (window 512, head_dim 256 sliding / 512 full) and context 4096, the sliding layers'
    cache bytes per decode call shrink by (C - 1) / window, the full layers' stay, computed from the two contracts."""
    from benchmarks.e2b_width import e2b_config

    cfg = e2b_config()
    layers = gemma4_layer_specs(cfg)
    ctx, window = 4096, cfg.sliding_window

    def kv_bytes(layout: CacheLayout, kind: AttentionKind) -> int:
        contract = RunnerContract.build(layers, vocab_size=cfg.vocab_size, context_len=ctx, sliding_window=window,
                                        ar_lens={PREFILL_METHOD: 128, DECODE_METHOD: 1}, cache_layout=layout)
        names = {f"{p}_cache_{l.index}" for l in layers if l.owns_cache and l.attention is kind for p in "kv"}
        return sum(4 * int(np.prod(t.shape)) for t in contract.method(DECODE_METHOD).inputs if t.name in names)

    sliding_full, sliding_ring = kv_bytes(CacheLayout.FULL, AttentionKind.SLIDING), kv_bytes(CacheLayout.RING, AttentionKind.SLIDING)
    assert sliding_full / sliding_ring >= (ctx - 1) / window
    assert kv_bytes(CacheLayout.FULL, AttentionKind.FULL) == kv_bytes(CacheLayout.RING, AttentionKind.FULL)
    assert sliding_ring == 12 * 2 * 256 * window * 4  # E2B: 12 cache-owning sliding layers, one KV head


def test_ring_that_cannot_help_is_refused() -> None:
    cfg = tiny_config()
    with pytest.raises(InvalidInputError, match="not fewer than"):
        StaticCausalLM.from_hf(tiny_model(cfg), max_context_len=cfg.sliding_window + 1, cache_layout=CacheLayout.RING)
    with pytest.raises(InvalidInputError, match="cache layout 'rings'; expected one of: full, ring"):
        StaticCausalLM.from_hf(tiny_model(cfg), max_context_len=CTX, cache_layout="rings")
