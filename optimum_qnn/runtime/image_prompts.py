"""Where images go in a chat prompt: the template renders one marker per image where its message's text begins, and
the ids take each image's block there (BOI, its soft tokens' placeholders, EOI), as Gemma 4's processor expands an
image token. Shared by `runtime.chat.ChatSession`, `QNNModelForImageTextToText.image_prompt_ids` and the server's
image content parts. Runtime code: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from optimum_qnn.errors import InvalidInputError

# Rendered by the chat template in place of each image: no text holds it, and no template trims it.
IMAGE_MARK = "\x00image\x00"


def marked(content: str, images: int) -> str:
    """A message's content with its ``images`` markers before its text."""
    return IMAGE_MARK * images + content


def check_unmarked(text: str, what: str) -> None:
    """Refuse text that holds the marker itself (it would be read as an image)."""
    if IMAGE_MARK in text:
        raise InvalidInputError(f"{what} holds the reserved sequence \\x00image\\x00")


def image_block(info: Any, soft_tokens: int) -> list[int]:
    """One image's ids: BOI, ``soft_tokens`` placeholders, EOI (``info``: the manifest's `ImagesInfo`)."""
    return [info.boi_token_id, *[info.image_token_id] * int(soft_tokens), info.eoi_token_id]


def encode_marked(tokenizer: Any, text: str, soft_tokens: Sequence[int], info: Any) -> list[int]:
    """The ids of ``text`` (a template's rendering, or its end) with each marker replaced by its image's block; the
    markers take ``soft_tokens``' last entries, in order (the images the text ends with). Special tokens come from the
    template's text only, as ``apply_chat_template(tokenize=True)`` does."""
    parts = text.split(IMAGE_MARK)
    marks = len(parts) - 1
    if marks > len(soft_tokens):
        raise InvalidInputError(f"The prompt holds {marks} image places and {len(soft_tokens)} images were given")
    counts = list(soft_tokens)[len(soft_tokens) - marks:]
    ids = _ids(tokenizer(parts[0], add_special_tokens=False))
    for n, part in zip(counts, parts[1:]):
        ids += image_block(info, n)
        ids += _ids(tokenizer(part, add_special_tokens=False)) if part else []
    return ids


def _ids(encoded: Any) -> list[int]:
    """The ids of a tokenizer call's result (a transformers `BatchEncoding`, a dict, or the ids themselves)."""
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    return [int(t) for t in ids]
