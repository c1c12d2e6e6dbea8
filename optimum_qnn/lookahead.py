"""Lookahead decoding's shape: ExecuTorch's ``--model_mode lookahead --ngram N --window W --gcap G``.

One decode call (``kv_forward``, AR tokens) carries a tree of guesses, laid out as ExecuTorch's Qualcomm runner lays
it out (``runner/lhd_token_generator.{h,cpp}`` at the commit of docs/running.md, read for facts):

- the lookahead branch: ``N - 1`` levels of ``W`` tokens. Level 0 is the current token then ``W - 1`` guesses, each
  row attending to the row before it; row ``j`` of level ``i >= 1`` attends to row ``j`` of level ``i - 1`` (and so to
  everything that row attends to). Level ``i``'s row ``j`` sits at position ``n_past + i + j``.
- the verification branch: ``G`` candidate n-grams of ``N - 1`` tokens that continue the current token (row 0),
  each token attending to the one before it; token ``j`` of a candidate sits at ``n_past + j + 1``.

So ``(W + G) * (N - 1)`` rows are used; ExecuTorch compiles ``kv_forward`` with AR the next power of two of that
(``wrappers/base_component.py``), and its runner reads AR from the attention mask's shape, N, W and G from its flags
(``--eval_mode 2 --ngram N --window W --gcap G``): the .pte holds no lookahead metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optimum_qnn.errors import InvalidInputError

EVAL_MODE = 2  # qnn_llama_runner's --eval_mode for lookahead decoding (0 kv, 1 hybrid)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Lookahead:
    """N, W and G of lookahead decoding (ExecuTorch's defaults: 5, 8, 8 -> AR 64).

    Args:
        ngram: N, the length of the n-grams guessed and verified (at least 2).
        window: W, how many future positions the lookahead branch guesses at once (at least 1).
        gcap: G, at most this many candidate n-grams verified per call (at least 1).
    """

    ngram: int = 5
    window: int = 8
    gcap: int = 8

    def __post_init__(self) -> None:
        for name, least in (("ngram", 2), ("window", 1), ("gcap", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidInputError(f"--{name} must be an integer >= {least}; got {value!r}")

    @property
    def rows(self) -> int:
        """Rows of a call the tree uses: ``(W + G) * (N - 1)``."""
        return (self.window + self.gcap) * (self.ngram - 1)

    @property
    def ar_len(self) -> int:
        """Tokens per decode call: the next power of two of `rows`, as ExecuTorch compiles ``kv_forward``."""
        return next_pow2(self.rows)

    @property
    def fills_ar(self) -> bool:
        """Whether the tree uses every row of a call. ExecuTorch's runner takes a parent row from its attention map
        for each of the call's AR rows, and the map holds `rows` entries (`KVManager::init_attention_mask`): below AR
        it reads past the map's end, and crashed there (a 16a8w export of N 4, W 3, G 3: 18 rows, AR 32). Its
        defaults (5, 8, 8: 64 rows) fill AR."""
        return self.rows == self.ar_len

    def runner_refusal(self) -> str | None:
        """Why ExecuTorch's ``qnn_llama_runner`` cannot run this shape, or None."""
        if self.fills_ar:
            return None
        return (f"ExecuTorch's qnn_llama_runner cannot run lookahead with --ngram {self.ngram} --window {self.window} "
                f"--gcap {self.gcap}: the tree fills {self.rows} of the decode call's {self.ar_len} rows, and the runner "
                f"reads a parent for every row, past the {self.rows} it has (it crashed). Export a shape whose "
                "(window + gcap) * (ngram - 1) is a power of two (ExecuTorch's 5, 8, 8 gives 64; 5, 4, 4 gives 32), or "
                "run this one on a host backend (device='host')")

    def parents(self) -> list[int]:
        """Row -> the row it continues (-1: only the cache), ExecuTorch's ``attention_map`` for this shape."""
        n, w = self.ngram, self.window
        parents = [j - 1 for j in range(w)]
        parents += [(i - 1) * w + j for i in range(1, n - 1) for j in range(w)]
        parents += [0 if j == 0 else (w + g) * (n - 1) + j - 1 for g in range(self.gcap) for j in range(n - 1)]
        return parents

    def offsets(self) -> list[int]:
        """Row -> its position after the call's first one (ExecuTorch's ``position_offset_``)."""
        offsets = [i + j for i in range(self.ngram - 1) for j in range(self.window)]
        return offsets + [j for _ in range(self.gcap) for j in range(1, self.ngram)]

    def verify_row(self, g: int, j: int) -> int:
        """The row of token ``j`` (1-based, < N) of candidate ``g``."""
        return self.window * (self.ngram - 1) + g * (self.ngram - 1) + j - 1

    def runner_args(self) -> list[str]:
        """The flags ExecuTorch's ``qnn_llama_runner`` runs this export with."""
        return ["--eval_mode", str(EVAL_MODE), "--ngram", str(self.ngram), "--window", str(self.window),
                "--gcap", str(self.gcap)]

    def to_dict(self) -> dict[str, object]:
        return {"ngram": self.ngram, "window": self.window, "gcap": self.gcap, "ar_len": self.ar_len,
                "runner_args": self.runner_args()}


def lookahead_of(manifest: Any) -> Lookahead | None:
    """N, W and G of a variant exported with ``--mode lookahead`` (from its `Manifest`), else None."""
    info = manifest.contract.lookahead
    return None if info is None else Lookahead(info.ngram, info.window, info.gcap)
