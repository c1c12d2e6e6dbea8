"""Conversations: `QNNModelForCausalLM.chat` returns a `ChatSession` that keeps what the model has already read.

The session holds the conversation twice: as messages (``history``) and as the exact token ids the model has read
(``input_ids``: each prompt as the chat template renders it, then the reply's own generated tokens, then the text
that closes the turn). The next turn appends only the template's text for the new message, so on the host backend
the KV caches of the earlier turns are reused (`generate(..., reuse_cache=True)`) and only the new tokens are
prefilled. A runner backend (a board, a phone) starts a process per call and prefills the whole conversation again.

When a turn does not fit the exported context, the oldest whole turns go (the system prompt stays), the kept ones are
rendered again and prefilled again, and the session says so once: a warning and ``stats.dropped_turns``.

On an image variant (`QNNModelForImageTextToText`) a message may carry images (``send(text, images=[...])``): each
is encoded once, when it is sent, and its block (BOI, its soft tokens' placeholders, EOI) opens that user turn; every
later turn passes the conversation's images again, and the host keeps their K/V with the rest of the prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from optimum_qnn.errors import InvalidInputError
from optimum_qnn.runtime.generation import GenerationStats
from optimum_qnn.runtime.image_prompts import check_unmarked, encode_marked, marked
from optimum_qnn.runtime.limits import DEFAULT_MAX_NEW_TOKENS, limits_of
from optimum_qnn.runtime.stops import conversation_stop_ids

logger = logging.getLogger(__name__)

# A user turn's images (the soft tokens of each) are kept under this key of its message; `history` leaves it out.
_IMAGES = "images"
# What `chat(**defaults)` and `send(**overrides)` pass on to `generate`.
GENERATION_OPTIONS = frozenset({"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "generator",
                                "speculative"})


class ChatSession:
    """A conversation with one model: ``send`` a user message, get the reply; the model keeps what it has read.

    Args:
        model: a loaded `QNNModelForCausalLM`.
        tokenizer: the artifact's tokenizer (with a chat template).
        system: an optional system prompt, kept when old turns are dropped.
        defaults: `generate` options for every reply (``do_sample``, ...; ``max_new_tokens`` unset: the rule of
            `limits.Limits.default_max_new_tokens`, as for every face).

    Example:

    ```python
    >>> chat = model.chat(system="You are terse.", max_new_tokens=64)
    >>> chat.send("What is a list comprehension?")
    >>> chat.send("And a generator expression?")  # prefills only this turn's tokens on the host
    ```
    """

    def __init__(self, model: Any, tokenizer: Any, system: str | None = None, **defaults: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidInputError(
                "This tokenizer has no chat template, so a conversation cannot be formatted: use generate() or "
                "text_generation(), or a tokenizer whose files hold a chat_template"
            )
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise InvalidInputError(f"system must be a non-empty string (or None); got {system!r}")
        self.model, self.tokenizer, self.system = model, tokenizer, system
        # A variant exported for lookahead decoding decodes with it (greedy output is the same, in fewer calls).
        speculative = getattr(model, "default_speculative", None)
        self.defaults = {**({"speculative": speculative} if speculative else {}), **_options(defaults, "chat()")}
        self.stats = GenerationStats()
        self.stop_ids = set(conversation_stop_ids(model.manifest.tokenizer.eos_ids, tokenizer))
        self.reset()

    @property
    def history(self) -> list[dict[str, str]]:
        """The conversation as chat messages: the system prompt (if any), then user and assistant turns."""
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return system + [{k: v for k, v in m.items() if k != _IMAGES} for m in self._turns]

    @property
    def input_ids(self) -> list[int]:
        """The token ids the model has read for this conversation (what the next turn starts with)."""
        return list(self._ids)

    def reset(self) -> None:
        """Forget every turn (the system prompt stays). The model's cache is not cleared: the next turn reuses what
        it shares with it (at least the system prompt)."""
        self._turns: list[dict[str, str]] = []
        self._ids: list[int] = []
        self._text = ""  # the template's rendering of the conversation that ``_ids`` holds

    def send(self, text: str, streamer: Any = None, cancel: Any = None, images: Any = None, **overrides: Any) -> str:
        """Add the user's ``text``, generate the reply and return it (without its end-of-turn token).

        ``streamer`` gets the reply's tokens as they come; ``cancel()`` returning True stops the reply there (what is
        generated so far is kept as the reply). ``images`` (paths, bytes or PIL images; an image variant only) open
        the message. ``overrides`` replace the session's `generate` options for this turn. A turn that does not fit
        drops the oldest turns (and their images); one that cannot fit even alone raises `ContextOverflowError` and
        leaves the session as it was.
        """
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError(f"A chat message must be a non-empty string; got {text!r}")
        check_unmarked(text, "A chat message")
        options = {**self.defaults, **_options(overrides, "send()")}
        if "eos_token_id" not in options:
            options["eos_token_id"] = sorted(self.stop_ids)
        turn = {"role": "user", "content": text}
        if images:
            turn[_IMAGES] = self._encoded(images)
        turns = self._turns + [turn]
        asked = options.get("max_new_tokens")
        ids, text_so_far, dropped, turns = self._prompt(turns, DEFAULT_MAX_NEW_TOKENS if asked is None else asked)
        if asked is None:
            options["max_new_tokens"] = limits_of(self.model).default_max_new_tokens(len(ids))
        features = [rows for t in turns for rows in t.get(_IMAGES, ())]
        if features:
            options["image_features"] = np.concatenate(features)
        out = self.model.generate_tokens(ids, streamer=streamer, cancel=cancel, reuse_cache=True, **options)
        new = out[0, len(ids):].tolist()
        stats = self.model.stats
        stats.dropped_turns = dropped
        self.stats = stats
        ended = bool(new) and stats.stopped_by == "eos"
        reply_ids = new[:-1] if ended else new
        reply = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
        self._turns = turns + [{"role": "assistant", "content": reply}]
        self._close(ids + new, text_so_far, reply, ended_by=new[-1] if ended else None)
        return reply

    def _encoded(self, images: Any) -> list[np.ndarray]:
        """Each image's soft tokens (``[n, hidden]``), from the variant's vision encoder."""
        if not getattr(self.model, "takes_images", False):
            raise InvalidInputError("This variant takes no images: load an image variant (export --task "
                                    "image-text-to-text) with QNNModelForImageTextToText, or `chat --image`")
        return self.model.encode_each(images)

    # --- the conversation as tokens ---------------------------------------------------------------------------

    def _render(self, turns: list[dict[str, Any]], open_reply: bool) -> str:
        """The template's text of ``turns``; a turn's images are one marker each where its content begins."""
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        messages = [{"role": t["role"], "content": marked(t["content"], len(t.get(_IMAGES, ())))} for t in turns]
        return self.tokenizer.apply_chat_template(system + messages, add_generation_prompt=open_reply, tokenize=False)

    def _encode(self, text: str, turns: list[dict[str, Any]] = ()) -> list[int]:
        """The ids of ``text`` (a rendering of ``turns``, or its end): each image marker becomes that image's block.
        The markers ``text`` holds are the last images of ``turns``."""
        # The template writes the special tokens (<bos>, the turn markers) as text, so nothing is added here (what
        # apply_chat_template(tokenize=True) does too).
        counts = [len(rows) for t in turns for rows in t.get(_IMAGES, ())]
        return encode_marked(self.tokenizer, text, counts, self.model.manifest.contract.images)

    def _prompt(self, turns: list[dict[str, str]], max_new_tokens: int):
        """The ids of the prompt for ``turns`` (ending with the new user message): the held ids plus the new text when
        the template only appends to what it rendered before, or the whole rendering; the oldest turns dropped while
        the prompt and the reply's reserve do not fit."""
        limits = limits_of(self.model)  # on a runner, the prompt must also leave its prefill method's AR slots
        capacity = limits.context_len
        reserve = max(1, min(max_new_tokens, capacity // 4))  # room for the reply; a longer one stops at context_full
        rendered = self._render(turns, open_reply=True)
        if self._ids and rendered.startswith(self._text):
            ids = self._ids + self._encode(rendered[len(self._text):], turns)
        else:
            ids = self._encode(rendered, turns)
        dropped = 0
        while limits.room(len(ids)) < reserve and len(turns) > 1:
            turns = turns[2:] if turns[1]["role"] == "assistant" else turns[1:]  # a user turn and its reply
            dropped += 1
            rendered = self._render(turns, open_reply=True)
            ids = self._encode(rendered, turns)
        if dropped:
            logger.warning(
                "The conversation no longer fits the exported context of %d tokens: dropped the oldest %d turn(s)%s "
                "and read the rest again", capacity, dropped, ", kept the system prompt" if self.system else "",
            )
        return ids, rendered, dropped, turns

    def _close(self, ids: list[int], prompt_text: str, reply: str, ended_by: int | None) -> None:
        """Hold ``ids`` (the prompt and the generated tokens) plus the tokens of the text that closes the reply's turn
        in the template (after an end-of-turn token the model generated itself, only what follows it)."""
        closed = self._render(self._turns, open_reply=False)
        head = prompt_text + reply
        if not closed.startswith(head):  # a template that rewrites earlier turns (e.g. trims them): render it all
            self._ids, self._text = self._encode(closed, self._turns), closed
            return
        tail = closed[len(head):]
        if ended_by is not None:
            said = self.tokenizer.decode([ended_by], skip_special_tokens=False)
            if tail.startswith(said):
                tail = tail[len(said):]
            else:  # the model ended with a token the template does not write there (e.g. <eos>): close as written
                ids = ids[:-1]
        self._ids = ids + (self._encode(tail) if tail else [])
        self._text = closed


def _options(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(values) - GENERATION_OPTIONS)
    if unknown:
        raise InvalidInputError(
            f"{where} got unknown option(s) {', '.join(unknown)}; expected some of: {', '.join(sorted(GENERATION_OPTIONS))}"
        )
    return dict(values)
