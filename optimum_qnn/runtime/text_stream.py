"""Text of a generation as its tokens come, never cut inside a character: the one incremental decoder of `chat`
(the terminal) and `serve` (streamed responses).

Why: a multi-byte UTF-8 character can span tokens (byte-fallback pieces); decoding a prefix that ends inside one gives
U+FFFD, which must not be shown and then replaced. Both faces held such text back with their own copy of this rule.
The whole token list is decoded each time (a tokenizer's decode is not additive across pieces: SentencePiece drops
the leading space of the first piece), and only the text after the last whole character is held back. The
tokenizer is duck-typed (``decode(ids, skip_special_tokens=True)``); nothing here imports torch or transformers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TextIO

_HALF = "\ufffd"  # what a decoder writes for bytes that do not (yet) make a character


class TextStream:
    """Decodes tokens as they are added. ``text`` is all of it so far; ``stable`` the part that later tokens cannot
    change (without a trailing half character); `take` gives text once (a caller may hold some back, e.g. what could
    still become a stop string), `take_stable` all the stable text not given yet."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.tokens: list[int] = []
        self.text = ""
        self._given = 0

    @property
    def stable(self) -> str:
        return self.text.rstrip(_HALF)

    def add(self, ids: Iterable[int]) -> None:
        """Add ``ids`` and decode everything again."""
        self.tokens += [int(i) for i in ids]
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special_tokens)

    def take_stable(self) -> str:
        """The whole characters not given yet (maybe "")."""
        return self.take(len(self.stable))

    def take(self, upto: int) -> str:
        """The text in ``[given, upto)`` (not before what was already given), marked as given."""
        new = self.text[self._given:upto] if upto > self._given else ""
        self._given = max(self._given, upto)
        return new

    def finish(self) -> str:
        """Everything not given yet, half characters included (the generation ended)."""
        return self.take(len(self.text))


class PrintingStreamer:
    """A `generate` streamer that prints the text as its tokens come (`put(ids)`: a tensor or an array of ids),
    whole characters only, and a newline at the end: `run`'s and `chat`'s output."""

    def __init__(self, tokenizer: Any, out: TextIO):
        self.stream, self.out = TextStream(tokenizer), out

    def put(self, value: Any) -> None:
        self.stream.add(value.reshape(-1).tolist())
        self.out.write(self.stream.take_stable())
        self.out.flush()

    def end(self) -> None:
        self.out.write(self.stream.finish() + "\n")
        self.out.flush()
