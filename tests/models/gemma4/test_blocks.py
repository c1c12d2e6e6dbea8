"""The blocks cache layout (each long cache cut into column blocks, each its own input) against Hugging Face and
the full layout.

Context 96, blocks of 24 slots (four blocks of the decode method's 95 and of the prefill method's 80), prefill chunks
of 16: prompts longer than a
block that cross several prefill chunks and block boundaries, decode past more of them; every logit within 1e-4 of
Hugging Face's eager model, greedy tokens equal to the full-length layout's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optimum_qnn import StaticCausalLM
from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD, CacheLayout, RunnerContract, column_blocks
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.models.gemma4.modules import gemma4_layer_specs
from tests.gemma4_tiny import CONFIGS, tiny_config, tiny_model
from tests.models.gemma4.test_parity import hf_step_logits

CTX, BLOCK, AR = 96, 24, 16


def test_column_blocks() -> None:
    assert column_blocks(95, 24) == [(0, 24), (24, 48), (48, 72), (72, 95)]
    assert column_blocks(80, 24) == [(0, 24), (24, 48), (48, 72), (72, 80)]
    assert column_blocks(95, None) == [(0, 95)]


def test_contract_lists_each_block_as_an_input() -> None:
    cfg = tiny_config()
    contract = RunnerContract.build(gemma4_layer_specs(cfg), vocab_size=cfg.vocab_size, context_len=CTX,
                                    ar_lens={PREFILL_METHOD: AR, DECODE_METHOD: 1}, sliding_window=cfg.sliding_window,
                                    cache_layout=CacheLayout.BLOCKS, block_len=BLOCK)
    assert contract.ring_len == cfg.sliding_window  # sliding layers keep the ring
    full = next(l for l in contract.cache_layers if l.attention.value == "full_attention")
    decode = {t.name: t.shape for t in contract.method(DECODE_METHOD).inputs}
    prefill = {t.name: t.shape for t in contract.method(PREFILL_METHOD).inputs}
    assert [decode[f"k_cache_{full.index}_block{b}"][-1] for b in range(4)] == [24, 24, 24, 23]
    assert [prefill[f"v_cache_{full.index}_block{b}"][-2] for b in range(4)] == [24, 24, 24, 8]
    assert f"k_cache_{full.index}_block4" not in decode
    assert f"k_cache_{full.index}" not in decode and "k_cache_0" in decode  # layer 0 slides: one ring input
    back = RunnerContract.from_dict(contract.to_dict())
    assert back == contract and back.block_len == BLOCK
    with pytest.raises(ValueError, match="needs block_len"):
        RunnerContract.build(contract.layers, vocab_size=cfg.vocab_size, context_len=CTX, ar_lens={DECODE_METHOD: 1},
                             sliding_window=cfg.sliding_window, cache_layout=CacheLayout.BLOCKS)
    # Blocks of 20: the decode call reads 95 slots in five blocks, the prefill call 80 in four.
    with pytest.raises(ValueError, match=r"different numbers of blocks .*prefill_forward: 4, kv_forward: 5.*at least 16"):
        RunnerContract.build(contract.layers, vocab_size=cfg.vocab_size, context_len=CTX, block_len=20,
                             ar_lens={PREFILL_METHOD: AR, DECODE_METHOD: 1}, sliding_window=cfg.sliding_window,
                             cache_layout=CacheLayout.BLOCKS)


@pytest.mark.parametrize("name", ["all_traits", "no_ple_no_share_kv"])
def test_blocks_match_hf_across_blocks_and_chunks(name: str) -> None:
    cfg = tiny_config(**CONFIGS[name])
    model = tiny_model(cfg)
    static = StaticCausalLM.from_hf(model, max_context_len=CTX, ar_len=AR, cache_layout=CacheLayout.BLOCKS,
                                    block_len=BLOCK)
    prompt_len = 2 * BLOCK + 7  # three prefill chunks and a remainder, across two block boundaries
    total = prompt_len + BLOCK + 5  # decode crosses another boundary
    ids = torch.randint(3, cfg.vocab_size, (1, total), generator=torch.Generator().manual_seed(7))
    expected = hf_step_logits(model, ids, prompt_len)
    session = static.session()
    got = torch.cat([session.feed(ids[0, :prompt_len])] + [session.feed(ids[0, t : t + 1]) for t in range(prompt_len, total)])
    diff = (got - expected).abs().max().item()
    print(f"{name}: max |logit diff| against Hugging Face {diff:.3g}")
    assert diff <= 1e-4, f"max |logit diff| {diff:.3g}"
    assert expected.abs().max() > 1.0


def test_blocks_greedy_equals_full_layout() -> None:
    cfg = tiny_config()
    model = tiny_model(cfg, seed=3)
    prompt = torch.randint(3, cfg.vocab_size, (1, BLOCK + 9), generator=torch.Generator().manual_seed(2))
    full = StaticCausalLM.from_hf(model, max_context_len=CTX, ar_len=AR).generate(prompt, max_new_tokens=60)
    blocks = StaticCausalLM.from_hf(model, max_context_len=CTX, ar_len=AR, cache_layout="blocks",
                                    block_len=BLOCK).generate(prompt, max_new_tokens=60)
    assert blocks.shape[1] == prompt.shape[1] + 60
    assert blocks.tolist() == full.tolist()


def test_block_len_goes_with_the_blocks_layout() -> None:
    cfg = tiny_config()
    with pytest.raises(InvalidInputError, match="needs block_len"):
        StaticCausalLM.from_hf(tiny_model(cfg), max_context_len=CTX, cache_layout=CacheLayout.BLOCKS)
    with pytest.raises(InvalidInputError, match="block_len 20 splits caches in the blocks layout only"):
        StaticCausalLM.from_hf(tiny_model(cfg), max_context_len=CTX, block_len=20)


def test_blocks_move_the_rings_bytes_at_e2b_32k() -> None:
    """At Gemma-4-E2B's layout and 32768 tokens, the blocks layout moves per call exactly the bytes of the ring layout
    (the same slots, cut into inputs of 8192), and the variant's memory estimate counts every block."""
    from benchmarks.io_bytes import call_bytes, contracts

    for method in (DECODE_METHOD, PREFILL_METHOD):
        ring, blocks = contracts(32768, 128, CacheLayout.RING)[1], contracts(32768, 128, CacheLayout.BLOCKS)[1]
        assert call_bytes(blocks, method) == call_bytes(ring, method)
        names = [t.name for t in blocks.method(method).inputs if t.name.startswith("k_cache_")]
        assert sum(n.endswith("_block3") for n in names) == 3 and not any(n.endswith("_block4") for n in names)
        big = max(np.prod(t.shape) * 2 for t in blocks.method(method).inputs if "_cache_" in t.name)
        assert big <= 8 * 2**20  # every cache input compiles (uint16)
