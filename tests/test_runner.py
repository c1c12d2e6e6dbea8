"""optimum_qnn.session.KVSession: the inputs it hands to each method call, against their definitions.

The methods here record their inputs and return outputs of the contract's shapes whose K/V slices encode the
position of each token, so the cache contents can be checked slot by slot.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD, AttentionKind, LayerSpec, RunnerContract
from optimum_qnn.ops.mask import attention_mask
from optimum_qnn.session import KVSession

CONTEXT, AR, WINDOW = 24, 4, 5


def make_session(window: int | None) -> tuple[KVSession, list[tuple[str, list[np.ndarray]]]]:
    layers = (
        LayerSpec(0, AttentionKind.SLIDING, 8, 1, 0, 0),
        LayerSpec(1, AttentionKind.FULL, 16, 2, 1, 1),
    )
    contract = RunnerContract.build(
        layers, vocab_size=32, context_len=CONTEXT, ar_lens={PREFILL_METHOD: AR, DECODE_METHOD: 1}, sliding_window=window
    )
    calls: list[tuple[str, list[np.ndarray]]] = []

    def method(name: str):
        spec = contract.method(name)

        def run(inputs):  # the session hands numpy arrays, as onnxruntime and ExecuTorch's methods get them
            calls.append((name, [t.copy() for t in inputs]))
            pos = inputs[3][0].astype(np.float32)
            outs = [np.zeros(o.shape, dtype=np.float32) for o in spec.outputs]
            for k in outs[1 : 1 + len(layers)]:
                k[:] = pos.reshape(1, 1, 1, -1)  # K slice [1, kv, hd, ar]: every entry = the token's position
            for v in outs[1 + len(layers) :]:
                v[:] = pos.reshape(1, 1, -1, 1)
            return outs

        return run

    return KVSession(contract, {m.name: method(m.name) for m in contract.methods}), calls


actions = st.lists(st.one_of(st.integers(1, 9), st.just("reset")), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(actions=actions, window=st.sampled_from([None, 1, WINDOW]))
def test_inputs_of_every_call_match_their_definition(actions, window):
    session, calls = make_session(window)
    for action in actions:
        if action == "reset":
            session.reset()
            continue
        n = min(action, session.capacity - session.n_past)
        if n == 0:
            continue
        before = len(calls)
        n_past = session.n_past
        session.feed(np.arange(n) + 3)
        for name, inputs in calls[before:]:
            ar = AR if name == PREFILL_METHOD else 1
            n_valid = int((inputs[0] != 0).sum())
            assert np.array_equal(inputs[1], attention_mask(ar, CONTEXT, n_past, n_valid=n_valid))
            assert np.array_equal(inputs[2], attention_mask(ar, CONTEXT, n_past, window=window, n_valid=n_valid))
            expected_pos = np.minimum(np.arange(n_past, n_past + ar), CONTEXT - 1)
            assert inputs[3].tolist() == [expected_pos.tolist()]
            # Cache slots [0, n_past) hold the positions written by earlier calls.
            for k in inputs[4:6]:
                assert np.array_equal(k[0, 0, 0, :n_past], np.arange(n_past, dtype=np.float32))
            n_past += n_valid
        assert session.n_past == n_past


def test_decode_steps_reuse_their_input_buffers():
    """No per-step allocation of masks, positions or tokens: every decode call gets the same tensors."""
    session, _ = make_session(WINDOW)
    seen = []
    decode = session.methods[DECODE_METHOD]
    session.methods[DECODE_METHOD] = lambda inputs: (seen.append([t.ctypes.data for t in inputs[:4]]), decode(inputs))[1]
    session.feed(np.arange(6) + 3)
    for _ in range(5):
        session.feed(np.array([7]))
    assert len(seen) == 5 and all(ptrs == seen[0] for ptrs in seen)
