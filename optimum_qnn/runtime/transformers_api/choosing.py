"""The next token of one row, chosen as transformers' ``generate`` chooses it, from the logits a backend computed.

Where transformers is importable, the scores go through its own processors (``generation/logits_process.py``) in
the order of transformers 5.23.0's ``GenerationMixin._get_logits_processor`` (repetition penalty, min length, min new
tokens, the caller's ``logits_processor``, then temperature, top-k, top-p when sampling), and a sample is
``torch.multinomial`` on the global generator (or the ``generator`` passed): after ``torch.manual_seed(n)`` or
``transformers.set_seed(n)`` a run repeats, and a single row draws exactly as transformers' does. On the runtime
install the same rules are applied in numpy (`_numpy_scores`) and drawn from numpy's generator.

A backend calls `RowChooser.pick` once per new token, in order (the plain decoding of `InProcessBackend`), so the
chooser holds the row's ids so far for the processors and the stopping criteria.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from optimum_qnn.runtime.transformers_api.options import GenerateOptions


def torch_available() -> bool:
    """Whether this install has torch and transformers (the full install): then their own classes are used."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class RowChooser:
    """Chooses the tokens of one row and says when its stopping criteria hold.

    Args:
        options: the call's resolved options.
        prompt: the row's ids without its left padding.
        pad_len: how many padding tokens the caller's row had (transformers counts them in ``min_length``).
        use_torch: apply transformers' processors with torch (else the numpy rules).
        generator: the caller's ``numpy.random.Generator`` or ``torch.Generator`` (None: torch's global one, or fresh
            numpy entropy on the runtime install).
        logits_processor: the caller's extra transformers ``LogitsProcessor`` objects (torch only).
        stopping_criteria: the caller's extra transformers ``StoppingCriteria`` objects (torch only).
        tokenizer: for ``stop_strings``.
    """

    def __init__(self, options: GenerateOptions, prompt: Sequence[int], pad_len: int, *, use_torch: bool,
                 generator: Any = None, logits_processor: Sequence[Any] = (), stopping_criteria: Sequence[Any] = (),
                 tokenizer: Any = None):
        self.options = options
        self.history = [int(t) for t in prompt]
        self.prompt_len = len(self.history)
        self.min_new = options.min_new(len(self.history) + pad_len)
        self.use_torch = use_torch
        self.generator = generator
        self.scores: list[np.ndarray] = []  # processed scores of each choice (``output_scores``)
        self.logits: list[np.ndarray] = []  # raw logits of each choice (``output_logits``)
        self.started = time.monotonic()
        # What a backend's own sampling checks read (`RunnerBackend.check_sampling`; greedy passes there).
        self.do_sample, self.temperature = options.do_sample, options.temperature
        self.top_k, self.top_p = options.top_k, options.top_p
        self._stop_ids = tuple(options.eos_token_id)
        self._tokenizer = tokenizer
        if use_torch:
            self._processors, self._criteria = _torch_lists(options, self.prompt_len, self.min_new, logits_processor,
                                                            stopping_criteria, tokenizer)

    def pick(self, logits: np.ndarray) -> int:
        """The next token after ``self.history`` from its row of ``logits``; appended to the history."""
        raw = np.asarray(logits, dtype=np.float32).reshape(-1)
        if self.use_torch:
            token, scores = self._pick_torch(raw)
        else:
            scores = _numpy_scores(raw, self.options, self.history, self.prompt_len, self.min_new)
            token = _draw_numpy(scores, self.generator) if self.options.do_sample else int(np.argmax(scores))
        if self.options.output_scores:
            self.scores.append(scores)
        if self.options.output_logits:
            self.logits.append(raw)
        self.history.append(token)
        return token

    def _pick_torch(self, raw: np.ndarray) -> tuple[int, np.ndarray]:
        import torch

        ids = torch.tensor([self.history], dtype=torch.long)
        scores = self._processors(ids, torch.from_numpy(raw.copy())[None])
        if self.options.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, num_samples=1, generator=_torch_generator(self.generator))[0, 0])
        else:
            token = int(torch.argmax(scores, dim=-1)[0])
        return token, scores[0].numpy()

    def stopped(self, ids: Sequence[int] | None = None) -> bool:
        """Whether the stopping criteria (``stop_strings``, ``max_time``, the caller's) hold after ``ids`` (default:
        the history); EOS and the length limits are the backend's own stops."""
        ids = self.history if ids is None else list(ids)
        if len(ids) <= self.prompt_len:
            return False
        if self.use_torch:
            if not self._criteria:
                return False
            import torch

            return bool(self._criteria(torch.tensor([ids], dtype=torch.long), None).any())
        if self.options.max_time is not None and time.monotonic() - self.started > self.options.max_time:
            return True
        return bool(self.options.stop_strings) and _ends_with_stop(ids, self.options.stop_strings, self._tokenizer)

    def cut(self, new: list[int]) -> list[int]:
        """``new`` up to and with the first token after which the stopping criteria hold (a backend that cannot stop
        early, or one whose stop came from a criterion, gives the same tokens)."""
        prompt = self.history[: self.prompt_len]
        for i in range(len(new)):
            if self.stopped(prompt + new[: i + 1]):
                return new[: i + 1]
        return new


def _torch_lists(options: GenerateOptions, prompt_len: int, min_new: int, extra_processors: Sequence[Any],
                 extra_criteria: Sequence[Any], tokenizer: Any) -> tuple[Any, Any]:
    """transformers' processors and stopping criteria for one row, in ``_get_logits_processor``'s order."""
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList, MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
        TopKLogitsWarper, TopPLogitsWarper,
    )
    from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList, StopStringCriteria

    processors = LogitsProcessorList()
    if options.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(options.repetition_penalty))
    eos = torch.tensor(options.eos_token_id, dtype=torch.long)
    if min_new > 0 and eos.numel():
        # min_length and min_new_tokens both come to "no EOS before min_new new tokens" for one unpadded row.
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, min_new, eos))
    processors.extend(extra_processors)
    if options.do_sample:
        if options.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(options.temperature))
        if options.top_k:
            processors.append(TopKLogitsWarper(top_k=options.top_k))
        if options.top_p is not None and options.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=options.top_p))
    criteria = StoppingCriteriaList()
    if options.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=options.max_time))
    if options.stop_strings:
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=list(options.stop_strings)))
    criteria.extend(extra_criteria)
    return processors, criteria


def _torch_generator(generator: Any) -> Any:
    """The torch generator to draw from: the caller's, else None (torch's global one, which ``manual_seed`` seeds)."""
    if generator is None or type(generator).__module__.startswith("torch"):
        return generator
    raise TypeError("a numpy generator reached the torch sampler")  # `generate` converts it first


def _numpy_scores(raw: np.ndarray, options: GenerateOptions, history: Sequence[int], prompt_len: int,
                  min_new: int) -> np.ndarray:
    """The rules of `_torch_lists`' processors in numpy (float32, as transformers computes them)."""
    scores = raw.copy()
    if options.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(history, dtype=np.int64))
        picked = scores[seen]
        scores[seen] = np.where(picked < 0, picked * options.repetition_penalty, picked / options.repetition_penalty)
    if len(history) - prompt_len < min_new and options.eos_token_id:
        scores[[e for e in options.eos_token_id if 0 <= e < scores.size]] = -np.inf
    if not options.do_sample:
        return scores
    if options.temperature != 1.0:
        scores = scores / np.float32(options.temperature)
    if options.top_k:
        k = min(options.top_k, scores.size)
        kth = np.partition(scores, -k)[-k]
        scores = np.where(scores < kth, -np.inf, scores).astype(np.float32)
    if options.top_p is not None and options.top_p < 1.0:
        order = np.argsort(scores, kind="stable")  # ascending, as TopPLogitsWarper sorts
        probs = _softmax(scores[order])
        remove = np.cumsum(probs) <= 1 - options.top_p
        remove[-1] = False  # the most likely token always stays
        scores[order[remove]] = -np.inf
    return scores


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - np.max(x))
    return e / e.sum()


def _draw_numpy(scores: np.ndarray, generator: Any) -> int:
    """One index from softmax(``scores``) with ``generator`` (a numpy Generator; None: fresh entropy)."""
    rng = generator if generator is not None else np.random.default_rng()
    cdf = np.cumsum(_softmax(scores))
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), cdf.size - 1))


def _ends_with_stop(ids: Sequence[int], stops: Sequence[str], tokenizer: Any) -> bool:
    """Whether the text of ``ids`` ends with one of ``stops`` (every token decodes to at least one character, so the
    last ``len(stop)`` tokens hold it)."""
    tail = tokenizer.decode(list(ids[-max(len(s) for s in stops) - 1:]), skip_special_tokens=False)
    return any(tail.endswith(s) for s in stops)
