"""Speculative decoding with Gemma 4's assistant (an MTP drafter, docs/assistant.md) on the host.

A round after the last token ``t`` (not yet fed; the target's cache holds positions ``[0, p)``):

1. K drafter calls at position ``p``: the first reads ``t`` and the target's final hidden state at ``p - 1``, each
   later one its own previous draft and ``hidden_out``; all read the target's K/V of ``[0, p)`` (its sliding layers
   the last ``window`` of them) through the masks the host builds (`ops.mask.draft_mask`);
2. one target call on ``t`` and the K drafts as a chain (`KVSession.chain_call`): row i's logits give the token
   after draft i;
3. the accepted prefix (`accept_drafts`) and one token of the target's own; the K/V of ``t`` and of every returned
   token but the last are kept (`KVSession.accept`), and the drafter's next hidden state is the target's at the row
   that gave the last returned token.

Greedy: a draft is accepted while it equals the target's argmax, so the output is plain greedy output. Sampling: the
standard speculative rule (accept draft d with probability ``min(1, p(d) / q(d))``, else draw from ``max(0, p - q)``
normalized; all accepted: one more token from the last row's ``p``), with ``p`` and ``q`` the target's and the
drafter's distributions under the same temperature / top-k / top-p (`generation.probabilities`), so every token is
drawn from the target's own sampling distribution; the draws come from the one generator, so a seeded run repeats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from optimum_qnn.artifacts.manifest import ManifestError
from optimum_qnn.ops.arrays import as_numpy
from optimum_qnn.ops.mask import draft_mask
from optimum_qnn.session import KVSession


@dataclass(frozen=True)
class Assistant:
    """What the runtime needs of a variant exported with an assistant.

    Args:
        draft_len: K, drafts per round.
        method: the drafter's method in the program (`contract.DRAFT_METHOD`).
        verify_ar: tokens of the target's decode call, K + 1.
        window: the drafter's sliding window.
    """

    draft_len: int
    method: str
    verify_ar: int
    window: int


def assistant_of(manifest: Any) -> Assistant | None:
    """The manifest's ``contract.assistant`` record as an `Assistant`, or None for a variant without a drafter: the
    one place that reads the record."""
    info = getattr(manifest.contract, "assistant", None)
    if info is None:
        return None
    return Assistant(info.draft_len, info.method, info.verify_ar, info.sliding_window)


def accept_drafts(drafts: Sequence[int], draft_probs: Sequence[np.ndarray], target_logits: np.ndarray,
                  sampling: Any) -> list[int]:
    """The tokens a round gives: the accepted prefix of ``drafts`` and one token of the target's own.

    Args:
        drafts: the K drafted tokens.
        draft_probs: when sampling, the K distributions the drafts were drawn from (``sampling.probabilities`` of
            the drafter's logits); unused when greedy.
        target_logits: ``[K + 1, vocab]``, the target's rows for the last token and each draft.
        sampling: `generation.Sampling`: greedy takes the argmax of each row (`Sampling.pick`); sampling applies
            the standard speculative rule with ``sampling``'s generator.

    Returns:
        1 to K + 1 tokens: drafts 0..m-1 then the target's token after them.
    """
    out: list[int] = []
    for i, draft in enumerate(drafts):
        if not sampling.do_sample:
            token = sampling.pick(target_logits[i])
            out.append(token)
            if token != draft:
                return out
            continue
        p, q = sampling.probabilities(target_logits[i]), draft_probs[i]
        if sampling.uniform() * q[draft] < p[draft]:  # accepted with probability min(1, p/q); q[draft] > 0
            out.append(int(draft))
            continue
        residual = np.maximum(p - q, 0.0)
        out.append(sampling.draw(residual if residual.sum() > 0 else p))
        return out
    out.append(sampling.pick(target_logits[len(drafts)]))
    return out


class AssistantDecoder:
    """Rounds of speculative decoding on ``session`` (its decode method takes ``assistant.verify_ar`` tokens and its
    methods output ``hidden``; ``draft`` is the drafter's method).

    Args:
        session: the session, holding the prompt's K/V (the current token not yet fed), its ``hidden`` the rows of
            the last call.
        assistant: the variant's record (`assistant_of`).
        draft: the drafter's method: inputs and outputs as ``session.contract.method(assistant.method)`` lists them.
        sampling: `generation.Sampling`.
    """

    def __init__(self, session: KVSession, assistant: Assistant, draft: Any, sampling: Any):
        self.session, self.assistant, self.draft, self.sampling = session, assistant, draft, sampling
        contract = session.contract
        self.spec = contract.method(assistant.method)
        verify_ar = session.decode_spec.ar_len
        if session.hidden is None or verify_ar != assistant.verify_ar or not 1 <= assistant.draft_len < verify_ar:
            raise ManifestError(
                f"The variant's assistant record (draft_len {assistant.draft_len}, verify_ar {assistant.verify_ar}) "
                f"does not fit its target (kv_forward takes {verify_ar} tokens"
                f"{'' if session.hidden is not None else ' and outputs no hidden state'}): re-export it"
            )
        self.hidden = session.hidden[-1]  # the target's hidden state at the position before the current token
        inputs = {t.name: t for t in self.spec.inputs}
        self.full_slots = inputs["atten_mask"].shape[-1]
        self.sliding_slots = inputs["sliding_atten_mask"].shape[-1]
        self.caches = [self._cache_view(t) for t in self.spec.inputs[5:]]
        self.ring_len = contract.ring_len
        self.tokens = np.zeros((1, 1), dtype=np.int64)
        self.pos = np.zeros((1, 1), dtype=np.int32)
        self.calls = 0  # target calls
        self.drafter_calls = 0
        self.drafted = 0  # drafts verified
        self.accepted = 0  # drafts accepted

    def _cache_view(self, spec: Any) -> np.ndarray:
        """The session's buffer that the drafter's cache input ``spec`` names (``k_cache_{i}`` / ``v_cache_{i}`` of
        the target's source layer i), cut to the input's slots: a view, so every call reads the current caches."""
        kind, index = spec.name.split("_cache_")
        owner = [layer.index for layer in self.session.cache_layers].index(int(index))
        if kind == "k":
            return self.session.k_bufs[owner][..., : spec.shape[-1]]
        return self.session.v_bufs[owner][:, :, : spec.shape[-2]]

    def masks(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """The drafter's two masks at ``position``, in its inputs' encoding."""
        c = self.session.contract
        full = draft_mask(c.context_len, position)[..., : self.full_slots]
        sliding = draft_mask(c.context_len, position, window=self.assistant.window, ring_len=self.ring_len)
        sliding = sliding[..., : self.sliding_slots]
        specs = self.spec.inputs[2:4]
        return tuple(s.quantize(m) if s.quantized else m for s, m in zip(specs, (full, sliding)))

    def _draft_step(self, token: int, hidden: np.ndarray, masks: tuple[np.ndarray, np.ndarray]
                    ) -> tuple[np.ndarray, np.ndarray]:
        """One drafter call: its logits (float32) and its ``hidden_out`` (float32)."""
        hidden_in = self.spec.inputs[1]
        hidden = hidden.reshape(hidden_in.shape).astype(np.float32)
        self.tokens[0, 0] = token
        inputs = [self.tokens, hidden_in.quantize(hidden) if hidden_in.quantized else hidden, *masks, self.pos,
                  *self.caches]
        outputs = self.draft(inputs)
        self.drafter_calls += 1
        logits, hidden_out = (as_numpy(o)[0, 0] for o in outputs[:2])
        logits_spec, hidden_spec = self.spec.outputs[:2]
        logits = logits_spec.dequantize(logits) if logits_spec.quantized else logits
        hidden_out = hidden_spec.dequantize(hidden_out) if hidden_spec.quantized else np.array(hidden_out)
        return logits, hidden_out

    def step(self, current: int, limit: int, eos: set[int]) -> list[int]:
        """One round after ``current`` (the last token, not yet fed): the next 1..min(K + 1, ``limit``) tokens,
        ending early at an EOS id. Keeps the K/V of ``current`` and of every returned token but the last."""
        session, sampling = self.session, self.sampling
        limit = min(limit, session.capacity - session.n_past)
        k = max(0, min(self.assistant.draft_len, limit - 1))  # no draft the round could not return
        position = session.n_past
        self.pos[0, 0] = position
        masks = self.masks(position) if k else None
        drafts: list[int] = []
        probs: list[np.ndarray] = []
        token, hidden = current, self.hidden
        for _ in range(k):
            logits, hidden = self._draft_step(token, hidden, masks)
            if sampling.do_sample:
                probs.append(sampling.probabilities(logits))
                token = sampling.draw(probs[-1])
            else:
                token = sampling.pick(logits)
            drafts.append(token)
        logits = session.chain_call(np.array([current, *drafts], dtype=np.int64))
        target_hidden = session.hidden
        self.calls += 1
        self.drafted += k
        out = accept_drafts(drafts, probs, logits, sampling)[:limit]
        for n, token in enumerate(out):
            if token in eos:
                out = out[: n + 1]
                break
        self.accepted += len(out) - 1
        session.accept([current, *out[:-1]], list(range(len(out))))
        self.hidden = target_hidden[len(out) - 1]
        return out

