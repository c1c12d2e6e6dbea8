"""The static drafter (Gemma 4's assistant) against transformers' Gemma4AssistantForCausalLM, fp32, on the K/V and
last hidden state of a real (tiny) target: the drafter's inputs as transformers' MTP candidate generator builds them."""

from __future__ import annotations

import pytest
import torch

from optimum_qnn import StaticCausalLM
from optimum_qnn.contract import AttentionKind, CacheLayout
from optimum_qnn.models.gemma4.assistant import StaticDrafter, drafter_sources
from tests.gemma4_assistant_tiny import tiny_assistant, tiny_assistant_config
from tests.gemma4_tiny import tiny_config, tiny_model

CTX = 32
DRAFTS = 3


def _target_states(target, ids: torch.Tensor):
    """What transformers hands the drafter after the target read ``ids``: the last hidden state (after the final
    norm) and the K/V of its last full and last sliding cache-owning layers, ``[1, kv, T, hd]``."""
    with torch.no_grad():
        out = target(ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    return out.hidden_states[-1][:, -1:], dict(out.shared_kv_states)


def _caches(drafter: StaticDrafter, shared: dict, p: int) -> list[torch.Tensor]:
    """The host's decode-sized buffers of the two source layers, positions ``[0, p)`` written where the layout puts
    them and every other slot random (a mask that leaked would show)."""
    contract = drafter.target.contract
    sources = drafter_sources(contract.layers)
    gen = torch.Generator().manual_seed(p)
    ks, vs = [], []
    for kind in (AttentionKind.FULL, AttentionKind.SLIDING):
        k_hf, v_hf = shared[kind.value]
        slots = contract.cache_slots(sources[kind])
        k = torch.randn(*k_hf.shape[:2], k_hf.shape[-1], slots, generator=gen)
        v = torch.randn(*v_hf.shape[:2], slots, v_hf.shape[-1], generator=gen)
        ring = contract.ring_len is not None and kind is AttentionKind.SLIDING
        for q in range(max(0, p - slots) if ring else 0, p):
            s = q % slots if ring else q
            k[..., s] = k_hf[:, :, q]
            v[:, :, s] = v_hf[:, :, q]
        ks.append(k)
        vs.append(v)
    return ks + vs


@pytest.mark.parametrize("layout", [CacheLayout.FULL, CacheLayout.RING], ids=["full", "ring"])
@pytest.mark.parametrize("ordered", [False, True], ids=["lm_head", "ordered-embeddings"])
def test_drafts_match_transformers(layout: CacheLayout, ordered: bool) -> None:
    """Three drafts per position, each fed its own argmax and hidden_out, at positions before, at and past the
    sliding window (8): logits and hidden_out within 1e-4 of Gemma4AssistantForCausalLM."""
    config = tiny_config()
    target = tiny_model(config, seed=1)
    assistant = tiny_assistant(tiny_assistant_config(config, ordered=ordered), seed=2)
    static_target = StaticCausalLM.from_hf(target, max_context_len=CTX, ar_len=4, cache_layout=layout)
    drafter = StaticDrafter.from_hf(assistant, static_target)
    window = config.sliding_window
    embed = target.get_input_embeddings()
    ids = torch.randint(3, config.vocab_size, (1, CTX), generator=torch.Generator().manual_seed(3))
    checked = 0
    for p in (3, window, window + 1, 21, CTX - 1):
        hidden, shared = _target_states(target, ids[:, :p])
        # The steady state of transformers' generation: the sliding layer hands over its last `window` columns.
        hf_kv = {"full_attention": shared["full_attention"],
                 "sliding_attention": tuple(t[:, :, -window:] for t in shared["sliding_attention"])}
        caches = _caches(drafter, shared, p)
        full, sliding = drafter.masks(p)
        pos = torch.tensor([[p]], dtype=torch.int32)
        token = ids[:, p : p + 1]
        hf_hidden, hf_token = hidden, token
        for _ in range(DRAFTS):
            with torch.no_grad():
                expected = assistant(inputs_embeds=torch.cat([embed(hf_token), hf_hidden], dim=-1),
                                     position_ids=pos.long(), shared_kv_states=hf_kv)
                logits, hidden_out = drafter.module(token, hidden, full, sliding, pos, *caches)
            torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
            torch.testing.assert_close(hidden_out, expected.last_hidden_state, atol=1e-4, rtol=0)
            hf_token, hf_hidden = expected.logits.argmax(-1), expected.last_hidden_state
            token, hidden = logits.argmax(-1), hidden_out
            assert torch.equal(token, hf_token)
            checked += 1
    assert checked == 5 * DRAFTS


def test_every_assistant_parameter_is_adopted_and_the_contract_names_the_target_caches() -> None:
    config = tiny_config()
    target = StaticCausalLM.from_hf(tiny_model(config), max_context_len=CTX, ar_len=4)
    assistant = tiny_assistant(tiny_assistant_config(config, ordered=True))
    drafter = StaticDrafter.from_hf(assistant, target)
    static_ids = {id(p) for p in drafter.module.parameters()}
    assert all(id(p) in static_ids for p in assistant.parameters())
    assert drafter.module.embed_tokens is target.module.model.embed_tokens
    names = [t.name for t in drafter.method.inputs]
    # Layers 2 (full) and 3 (sliding) are the tiny target's last cache owners (kv_sharing_modes "store").
    assert names == ["tokens", "hidden", "atten_mask", "sliding_atten_mask", "input_pos",
                     "k_cache_2", "k_cache_3", "v_cache_2", "v_cache_3"]
    decode = {t.name: t.shape for t in target.contract.method("kv_forward").inputs}
    assert all(t.shape == decode[t.name] for t in drafter.method.inputs[5:])
    assert [t.shape for t in drafter.method.outputs] == [(1, 1, config.vocab_size), (1, 1, config.hidden_size)]
    assert [tuple(x.shape) for x in drafter.example_inputs()] == [t.shape for t in drafter.method.inputs]


def test_a_target_built_for_an_assistant_also_returns_its_last_hidden_state() -> None:
    """``hidden_output``: every method returns the final hidden state last, equal (1e-4) to transformers'
    ``hidden_states[-1]`` over a prefill chunk and decode steps past the window; without it the contract is as it was."""
    config = tiny_config()
    target = tiny_model(config, seed=5)
    plain = StaticCausalLM.from_hf(target, max_context_len=CTX, ar_len=4)
    static = StaticCausalLM.from_hf(target, max_context_len=CTX, ar_len=4, hidden_output=True)
    for with_hidden, without in zip(static.contract.methods, plain.contract.methods):
        assert with_hidden.inputs == without.inputs
        assert with_hidden.outputs[:-1] == without.outputs
        assert (with_hidden.outputs[-1].name, with_hidden.outputs[-1].shape) == ("hidden", (1, with_hidden.ar_len, 64))
    rows: list[torch.Tensor] = []

    def recording(fn):
        def run(inputs):
            outputs = fn(inputs)
            rows.append(outputs[-1])
            return outputs
        return run

    session = static.session()
    session.methods = {name: recording(fn) for name, fn in session.methods.items()}
    ids = torch.randint(3, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(6))
    session.feed(ids[0, :8])
    for t in range(8, 20):
        session.feed(ids[0, t : t + 1])
    got = torch.cat([r[0] for r in rows])
    with torch.no_grad():
        expected = target(ids, output_hidden_states=True, use_cache=False).hidden_states[-1][0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
