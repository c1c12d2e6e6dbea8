"""The artifact's tokenizer without transformers: ``tokenizer.json`` through the `tokenizers` library, the chat
template through jinja2, the special tokens from ``tokenizer_config.json``.

The runtime installs without torch and transformers (Windows on Snapdragon, Linux boards), so it reads the files the
export copied beside the variants itself. It follows transformers 5.23's `TokenizersBackend` on the points a Gemma4
artifact uses (`tests/test_tokenizer.py` compares the two on the demo tokenizer):
- ``add_special_tokens=True`` applies tokenizer.json's post-processor (transformers' tokenizer classes may rebuild
  it from ``add_bos_token`` / ``add_eos_token``; for the demo's class it does not, and the runtime follows the file);
- decoding cleans up tokenization spaces only when the config asks (``clean_up_tokenization_spaces``);
- the chat template renders in a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the
  ``tojson`` filter that does not escape HTML, ``raise_exception`` and ``strftime_now``
  (transformers' ``utils/chat_template_utils.py``), and the special tokens as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from optimum_qnn.errors import InvalidInputError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _content(token: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with its ``content``."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


class ArtifactTokenizer:
    """The tokenizer files of an artifact folder, with the calls the runtime makes of a Hugging Face tokenizer:
    ``tokenizer(text, add_special_tokens=...)["input_ids"]``, ``encode``, ``decode``, ``apply_chat_template``,
    ``chat_template``, ``get_vocab``, ``convert_tokens_to_ids``, ``eos_token_id`` / ``bos_token_id``.

    Args:
        folder: the folder holding ``tokenizer.json`` (and usually ``tokenizer_config.json``).

    Raises:
        InvalidInputError: the folder has no ``tokenizer.json``, or a file cannot be read.
    """

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        path = self.folder / TOKENIZER_FILE
        if not path.is_file():
            raise InvalidInputError(
                f"The artifact at {self.folder} has no tokenizer files (no {TOKENIZER_FILE}; its source model had "
                "none): pass token ids "
                "(generate(), --prompt-ids), or export from a model folder that holds its tokenizer"
            )
        try:
            self._tok = Tokenizer.from_file(str(path))
            config_path = self.folder / CONFIG_FILE
            self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception on a malformed file)
            raise InvalidInputError(f"Cannot read the tokenizer files in {self.folder}: {e}") from None
        template = self.folder / TEMPLATE_FILE
        self.chat_template: str | None = template.read_text() if template.is_file() else self.config.get("chat_template")
        self.special_tokens = {name: _content(self.config.get(name)) for name in _SPECIAL}
        self._compiled: tuple[str, Any] | None = None

    # --- ids ---------------------------------------------------------------------------------------------------
    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        token = self.special_tokens["bos_token"]
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        token = self.special_tokens["eos_token"]
        return None if token is None else self._tok.token_to_id(token)

    # --- text -> ids -> text -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        if not isinstance(text, str):
            raise InvalidInputError(f"The tokenizer takes one string; got {type(text).__name__}")
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if ids and isinstance(ids[0], list):  # one sequence of a batch of one
            ids = ids[0]
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.config.get("clean_up_tokenization_spaces"):
            for spaced, tight in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(spaced, tight)
        return text

    # --- conversations -----------------------------------------------------------------------------------------
    def _template(self):
        """The chat template compiled (once per template text: a caller may set ``chat_template``)."""
        if self._compiled is not None and self._compiled[0] == self.chat_template:
            return self._compiled[1]
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._compiled = (self.chat_template, env.from_string(self.chat_template))
        return self._compiled[1]

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, **variables: Any) -> str | list[int]:
        """The conversation through the chat template: its text, or (``tokenize=True``) its ids, special tokens
        coming from the template only."""
        if not self.chat_template:
            raise InvalidInputError(
                f"The tokenizer in {self.folder} has no chat template: use plain prompts (no --chat), or export from a "
                "model whose tokenizer_config.json or chat_template.jinja holds one"
            )
        text = self._template().render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.special_tokens.items() if v is not None}, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text
