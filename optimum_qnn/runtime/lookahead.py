"""Lookahead decoding on the host, the algorithm of ExecuTorch's ``qnn_llama_runner --eval_mode 2``
(``runner/lhd_token_generator.cpp``, read for facts; `optimum_qnn.lookahead` describes the tree of one call).

Each decode call runs the current token, the lookahead branch's guesses and up to G candidate n-grams that begin with
the current token (from a pool the lookahead branch fills). The current token's row gives the next token; a
candidate whose first token equals it is verified further, row by row, while its tokens keep equalling what the rows
before them give. So every token comes from the rows of tokens that were accepted, as plain decoding would compute
it: greedy output is plain greedy output, and up to N tokens come out of one call.

After a call only the accepted rows' K/V are kept (`KVSession.accept`), in order, at the slots after the cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from optimum_qnn.lookahead import Lookahead
from optimum_qnn.session import KVSession


class LookaheadDecoder:
    """Decode steps of lookahead decoding on ``session`` (its decode method takes ``lookahead.ar_len`` tokens).

    Args:
        session: the session, holding the prompt's K/V (the current token not yet fed).
        lookahead: N, W and G of the export.
        prompt: the prompt ids; the lookahead branch starts as tokens drawn from them (as ExecuTorch's runner does,
            with a fixed seed here so a run repeats).
        sampling: picks a token from a row of logits (`generation.Sampling`).
    """

    def __init__(self, session: KVSession, lookahead: Lookahead, prompt: np.ndarray, sampling: Any):
        self.session, self.shape, self.sampling = session, lookahead, sampling
        n, w, g = lookahead.ngram, lookahead.window, lookahead.gcap
        self.parents, self.offsets = lookahead.parents(), lookahead.offsets()
        source = prompt[1:] if prompt.size > 1 else prompt
        self.levels = np.random.default_rng(0).choice(source, size=(n - 1, w)).astype(np.int64)
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> up to G n-grams that followed it
        self.pool_head: dict[int, int] = {}
        self.calls = 0
        self.drafted = 0  # guessed positions a call could verify: N - 1 whenever it had a candidate
        self.accepted = 0  # guessed tokens accepted

    def step(self, current: int, limit: int, eos: set[int]) -> list[int]:
        """One decode call after ``current`` (the last token, not yet fed): the next 1..min(N, ``limit``) tokens,
        ending early at an EOS id. Keeps the K/V of ``current`` and of every returned token but the last."""
        shape, session = self.shape, self.session
        n, w = shape.ngram, shape.window
        candidates = list(self.pool.get(current, ()))  # a copy: the pool changes below, before they are verified
        tokens = np.zeros(shape.rows, dtype=np.int64)
        tokens[: w * (n - 1)] = self.levels.reshape(-1)
        tokens[0] = current
        for g, gram in enumerate(candidates):
            start = shape.verify_row(g, 1)
            tokens[start : start + n - 1] = gram
        logits = session.tree_call(tokens, self.parents, self.offsets)
        self.calls += 1
        self.drafted += (n - 1) if candidates else 0
        limit = min(limit, session.capacity - session.n_past)
        rows, out = [0], [self.sampling.pick(logits[0])]
        self._advance_branch(logits)
        active = list(range(len(candidates)))
        for v in range(1, n):
            active = [g for g in active if candidates[g][v - 1] == out[-1]]
            if not active or len(out) >= limit or out[-1] in eos:
                break
            row = shape.verify_row(active[0], v)
            rows.append(row)
            out.append(self.sampling.pick(logits[row]))
            self.accepted += 1
        out = out[:limit]
        session.accept(tokens[rows[: len(out)]], rows[: len(out)])
        return out

    def _advance_branch(self, logits: np.ndarray) -> None:
        """Shift the lookahead branch up a level, fill its last level from the logits, and pool the n-grams it
        completed (each level-0 token followed by its column)."""
        n, w, g = self.shape.ngram, self.shape.window, self.shape.gcap
        first = self.levels[0].copy()
        self.levels[:-1] = self.levels[1:].copy()
        last = (n - 2) * w
        self.levels[-1] = np.argmax(logits[last : last + w], axis=-1)
        for f in range(w):
            start, gram = int(first[f]), tuple(int(t) for t in self.levels[:, f])
            grams = self.pool.setdefault(start, [])
            if gram in grams:
                continue
            head = self.pool_head.get(start, 0)
            if head < len(grams):
                grams[head] = gram
            else:
                grams.append(gram)
            self.pool_head[start] = (head + 1) % g
