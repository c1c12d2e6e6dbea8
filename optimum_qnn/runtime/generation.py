"""What every runtime backend shares: the checks of `generate`'s arguments, the sampling rule, the stats.

A backend (`runtime/backends/`) runs the tokens; these run before it starts, so bad input gets the same error on
the host, on a board and on a phone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from optimum_qnn.errors import InvalidInputError
from optimum_qnn.ops.arrays import as_numpy, is_torch

# What `from_pretrained(..., device="runner" | "adb", **options)` hands to `backends.runner.RunnerBackend`.
RUNNER_OPTIONS = frozenset({"runner", "qnn_sdk_root", "shared_buffer"})


def check_selection(**values: Any) -> None:
    """soc, quant and revision are strings, context_len an integer > 0, cache_layout 'full', 'ring' or 'blocks', max_memory
    a positive number of GB (None: any); a wrong type would otherwise fail deep in the index lookup or the Hub
    client."""
    for name in ("soc", "quant", "revision"):
        value = values[name]
        if value is not None and (not isinstance(value, str) or not value.strip()):
            example = {"soc": "'SM8650'", "quant": "'16a8w'", "revision": "'main' or a commit"}[name]
            raise InvalidInputError(f"{name} must be a non-empty string such as {example} (or None); got {value!r}")
    context_len = values["context_len"]
    if context_len is not None and (isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 1):
        raise InvalidInputError(f"context_len must be a positive integer such as 1024 (or None); got {context_len!r}")
    layout = values.get("cache_layout")
    if layout is not None and layout not in ("full", "ring", "blocks"):
        raise InvalidInputError(f"cache_layout must be 'full', 'ring' or 'blocks' (or None); got {layout!r}")
    memory = values.get("max_memory")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0
                               or memory == float("inf")):
        raise InvalidInputError(f"max_memory must be a positive number of GB such as 8 or 7.5 (or None); got {memory!r}")


@dataclass
class GenerationStats:
    """Timings of the last `generate` call."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    reused_tokens: int = 0  # leading prompt tokens whose K/V the cache already held (``reuse_cache=True``)
    prefilled_tokens: int = 0  # prompt tokens run through the model: prompt_tokens - reused_tokens
    dropped_turns: int = 0  # a chat turn that did not fit: how many of the oldest turns were dropped (`runtime.chat`)
    time_to_first_token_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    host_overhead_share: float = 0.0
    stopped_by: str = ""
    step_times: list[float] = field(default_factory=list)  # seconds of each decode call
    speculative: str = ""  # "lookahead" or "assistant" when the decode calls verified guesses, else ""
    decode_tokens: int = 0  # new tokens the decode calls gave (all but the first, which the prompt's logits give)
    drafted_tokens: int = 0  # guessed positions the calls could verify (lookahead: N - 1 a call that had a candidate)
    accepted_tokens: int = 0  # guessed tokens accepted
    drafter_calls: int = 0  # calls of the assistant's drafter (speculative="assistant"): K per target call

    @property
    def target_calls(self) -> int:
        """Decode calls of the exported model."""
        return len(self.step_times)

    @property
    def tokens_per_target_call(self) -> float:
        """New tokens per decode call: 1 for plain decoding, up to N with lookahead, up to K + 1 with an assistant."""
        return self.decode_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted guessed tokens / guessed positions verified (None without guesses)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (``do_sample=False``) or sampled with these filters."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: Any = None  # a numpy Generator, a torch.Generator, or None (fresh entropy)

    def pick(self, logits: np.ndarray) -> int:
        return pick(logits, self.do_sample, self.temperature, self.top_k, self.top_p, self.generator)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution `pick` draws from when sampling (temperature, top-k and top-p applied), float64."""
        return probabilities(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, probs: np.ndarray) -> int:
        """One token from ``probs`` (any non-negative weights), one uniform number from ``generator``."""
        return draw(probs, self.generator)

    def uniform(self) -> float:
        """One number in [0, 1) from ``generator``."""
        return _uniform(self.generator)


def prompt_ids(input_ids) -> np.ndarray:
    """``input_ids`` (a list of ints, a numpy array, or a torch tensor) as a 1-D int64 array, or `InvalidInputError`
    saying what is wrong with them."""
    if isinstance(input_ids, (str, bytes)):
        raise InvalidInputError(
            f"input_ids must be token ids (a list of ints or an integer array); got {type(input_ids).__name__} "
            "(tokenize text with the model's tokenizer, or use text_generation)"
        )
    try:
        ids = as_numpy(input_ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InvalidInputError(
            f"input_ids must be token ids (a list of ints or an integer array); got {type(input_ids).__name__} ({e})"
        ) from None
    kind = "torch tensor" if is_torch(input_ids) else type(input_ids).__name__
    if ids.dtype.kind in "OUSV":
        raise InvalidInputError(
            f"input_ids must be token ids (a list of ints or an integer array); got a {kind} of {ids.dtype} values"
        )
    if ids.dtype.kind not in "iu" and ids.size:
        raise InvalidInputError(
            f"input_ids must be integer token ids; got a {ids.dtype} {kind} (tokenize text with the model's tokenizer, "
            "or convert to integers if the values are whole)"
        )
    if ids.ndim == 2 and ids.shape[0] != 1 or ids.ndim > 2:
        raise InvalidInputError(
            f"input_ids has shape {tuple(ids.shape)}: the exported runner generates for one sequence at a time "
            "(batch size 1); pass a 1-D sequence or shape [1, N], and loop over prompts"
        )
    ids = ids.reshape(-1).astype(np.int64)
    if ids.size == 0:
        raise InvalidInputError("The prompt is empty: pass at least one token id (e.g. the BOS id)")
    return ids  # the range of the ids is checked by the session, for every call


SPECULATIVE = ("lookahead", "assistant")
# How to export a variant for each kind (the fix a refusal gives).
_EXPORT_FOR = {
    "lookahead": "`optimum-qnn export ... --mode lookahead --ngram N --window W --gcap G`",
    "assistant": "`optimum-qnn export ... --assistant REPO_OR_DIR` (a Gemma 4 assistant beside its target) and run "
                 "it on a host device (ExecuTorch's C++ runner has no drafter)",
}


def check_speculative(speculative: Any, choices: Sequence[str], variant: str) -> None:
    """``speculative`` of `generate`: None, or a kind the variant was exported for (``choices``: ``lookahead`` for a
    variant exported with ``--mode lookahead``, whose manifest records N, W and G; ``assistant`` for one exported
    with a drafter, whose manifest records ``contract.assistant``)."""
    if speculative is None:
        return
    if speculative not in SPECULATIVE:
        raise InvalidInputError(f"speculative must be None or one of: {', '.join(SPECULATIVE)}; got {speculative!r}")
    if speculative not in choices:
        has = f"has only speculative={choices[0]!r}" if choices else "has no speculative decoding"
        raise InvalidInputError(
            f"speculative={speculative!r} needs a variant exported for it; {variant} was not (it {has}): export one "
            f"with {_EXPORT_FOR[speculative]}, or leave speculative unset"
        )


def check_generate_args(max_new_tokens, do_sample, temperature, top_k, top_p, streamer, generator, cancel=None) -> None:
    """The arguments of `generate` besides the prompt, checked before the first token (host and phone alike)."""
    if cancel is not None and not callable(cancel):
        raise InvalidInputError(f"cancel must be a callable returning True to stop (or None); got {type(cancel).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InvalidInputError(f"max_new_tokens must be an integer >= 0; got {max_new_tokens!r}")
    check_sampling(do_sample, temperature, top_k, top_p)
    if streamer is not None and not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise InvalidInputError(f"streamer must have put(tensor) and end() methods (e.g. a TextStreamer); got {type(streamer).__name__}")
    if generator is not None and not (isinstance(generator, np.random.Generator) or _is_torch_generator(generator)):
        raise InvalidInputError(
            f"generator must be a numpy.random.Generator or a torch.Generator; got {type(generator).__name__}"
        )


def _is_torch_generator(generator: Any) -> bool:
    return type(generator).__module__.startswith("torch") and hasattr(generator, "manual_seed")


def eos_ids(eos_token_id, *, default: Sequence[int]) -> set[int]:
    """`generate`'s ``eos_token_id`` as a set of ids: None means ``default`` (the manifest's)."""
    if eos_token_id is None:
        return set(default)
    if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool):
        return {eos_token_id}
    if isinstance(eos_token_id, (list, tuple, set)) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos_token_id):
        return set(eos_token_id)
    raise InvalidInputError(f"eos_token_id must be an int, a list of ints or None; got {eos_token_id!r}")


def common_prefix(held: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading tokens ``held`` and ``prompt`` share."""
    n = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        n += 1
    return n


def check_sampling(do_sample: bool, temperature, top_k, top_p) -> None:
    """Sampling arguments as Hugging Face's generate accepts them, checked before the first token."""
    if not isinstance(do_sample, bool):
        raise InvalidInputError(f"do_sample must be True or False; got {do_sample!r}")
    if not do_sample:
        return
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise InvalidInputError(f"temperature must be a finite number > 0 when sampling; got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise InvalidInputError(f"top_k must be an integer >= 0 (0 or None: no top-k filter); got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not math.isfinite(top_p) or not 0 < top_p <= 1
    ):
        raise InvalidInputError(f"top_p must be in (0, 1] (1 or None: no nucleus filter); got {top_p!r}")


def pick(logits: np.ndarray, do_sample: bool, temperature: float, top_k, top_p, generator) -> int:
    """The next token from one row of logits: the first maximum when greedy, else one draw from the filtered
    softmax. The draw is one uniform number from ``generator`` (a numpy or a torch generator: seeded, it repeats)
    mapped through the cumulative distribution."""
    logits = as_numpy(logits)
    if not do_sample:
        return int(np.argmax(logits))
    check_sampling(do_sample, temperature, top_k, top_p)
    return draw(probabilities(logits, temperature, top_k, top_p), generator)


def probabilities(logits: np.ndarray, temperature: float, top_k, top_p) -> np.ndarray:
    """The filtered softmax of one row of logits that `pick` samples from: scaled by ``temperature``, then only the
    ``top_k`` best, then the smallest set whose probability reaches ``top_p`` (float64, sums to 1)."""
    scores = as_numpy(logits).astype(np.float64) / temperature
    if top_k is not None and top_k > 0:
        kth = np.partition(scores, -min(top_k, scores.size))[-min(top_k, scores.size)]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p is not None and 0 < top_p < 1:
        order = np.argsort(-scores, kind="stable")
        probs = _softmax(scores[order])
        drop = np.cumsum(probs) - probs > top_p  # keep the token that crosses top_p
        scores[order[drop]] = -np.inf
    return _softmax(scores)


def draw(probs: np.ndarray, generator: Any) -> int:
    """One index drawn from ``probs`` (non-negative, not necessarily normalized): one uniform number from
    ``generator`` mapped through the cumulative distribution."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, _uniform(generator) * cdf[-1], side="right"), cdf.size - 1))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def _uniform(generator: Any) -> float:
    """One draw in [0, 1) from ``generator``."""
    if generator is None:
        return float(np.random.default_rng().random())
    if isinstance(generator, np.random.Generator):
        return float(generator.random())
    import torch  # a torch.Generator was given, so torch is installed

    return float(torch.rand((), generator=generator, dtype=torch.float64))
