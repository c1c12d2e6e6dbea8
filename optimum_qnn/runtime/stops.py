"""The token ids a generation stops at: one rule for a conversation, and the runner's own.

Why here: the ids were worked out in three places (`chat`, the server, the runner backend), and `run --chat` and
`text_generation(chat=True)` used none of them, so they ran past Gemma4's ``<turn|>`` to the manifest's EOS. A chat
reply, wherever it is generated, stops at `conversation_stop_ids`. The tokenizer is duck-typed (a Hugging Face
tokenizer or a ``tokenizers.Tokenizer``: ``get_vocab()``); nothing here imports torch or transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Tokens that end a model turn in the Gemma chat formats (Gemma4's, and Gemma 2/3's): stop ids where the vocabulary
# has them.
TURN_END_TOKENS = ("<turn|>", "<end_of_turn>")


def turn_end_ids(vocab: Mapping[str, int]) -> set[int]:
    """The ids of the `TURN_END_TOKENS` that ``vocab`` has."""
    return {vocab[t] for t in TURN_END_TOKENS if t in vocab}


def conversation_stop_ids(eos_ids: Iterable[int], tokenizer: Any) -> list[int]:
    """The stop ids of a chat reply: the manifest's EOS ids and the tokenizer's end-of-turn tokens, sorted."""
    return sorted(set(eos_ids) | turn_end_ids(tokenizer.get_vocab()))


def text_stop_ids(eos_ids: Iterable[int], tokenizer: Any, chat: bool) -> list[int]:
    """The stop ids of a prompt formatted with the chat template (``chat``) or not (the manifest's EOS ids only)."""
    return conversation_stop_ids(eos_ids, tokenizer) if chat else sorted(set(eos_ids))


def runner_stop_ids(eos_token: Any, tokenizer: Any, fallback_eos: Iterable[int]) -> set[int]:
    """The ids ExecuTorch's ``qnn_llama_runner`` stops at for Gemma4 (``runner.cpp``), which no flag changes: the EOS
    that tokenizer_config.json names (``eos_token``: a string or ``{"content": ...}``; else ``fallback_eos``) and the
    first id of ``encode("<turn|>")``. ``tokenizer``: a ``tokenizers.Tokenizer``."""
    name = eos_token if isinstance(eos_token, str) else (eos_token or {}).get("content") if eos_token else None
    eos_id = tokenizer.token_to_id(name) if name else None
    stops = {eos_id} if eos_id is not None else set(fallback_eos)
    turn = tokenizer.encode("<turn|>", add_special_tokens=False).ids
    if turn:
        stops.add(turn[0])
    return stops
