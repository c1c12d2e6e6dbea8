"""How many tokens a variant takes on a backend, and how many it may generate: one rule, used by every face.

Why here: the limit used to be written four times with different bounds (the server refused at >= C, the host
backend at > C, the runner backend at C - AR), so the server accepted prompts the runner then refused. Every face
(`generate`, `text_generation`, `run`, `chat`, `serve`) now asks `Limits`. Plain ints only: the contract is
duck-typed (``context_len``, ``methods`` with ``name`` and ``ar_len``); nothing here imports torch or transformers.

The rule, per backend kind (a new backend is one more entry of `_PROMPT_LIMIT`):

- ``host`` (ExecuTorch's Python runtime, `backends.host`): a prompt of up to C tokens; its last logits give the first
  new token, and each new token fed back takes a slot, so C - P + 1 tokens can follow a prompt of P.
- ``runner`` / ``adb`` (ExecuTorch's ``qnn_llama_runner``): its prompt processor needs
  ``start_pos + prompt_len <= CL - AR`` (``prompt_processor.cpp``), AR of the method that prefills
  (``prefill_forward`` in hybrid mode, else ``kv_forward``'s 1); it generates up to ``--seq_len`` = C positions in
  all, so C - P tokens follow. A lookahead export (``kv_forward`` of AR > 1, its ``--eval_mode 2``) stops once a
  round has taken the position past C - AR (``lhd_token_generator.cpp``): C - AR + 1 positions are sure, so
  C - AR + 1 - P tokens follow.

``max_new_tokens`` left unset means `DEFAULT_MAX_NEW_TOKENS`, never more than the room after the prompt: the same
default for `generate`, `text_generation`, `run`, `chat` (per reply) and `serve` (``max_tokens`` unset).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optimum_qnn.errors import ContextOverflowError

DEFAULT_MAX_NEW_TOKENS = 256
PREFILL_METHOD = "prefill_forward"  # `contract.PREFILL_METHOD`, named again so this module stays import-light
DECODE_METHOD = "kv_forward"
BACKEND_KINDS = ("host", "runner", "adb")


def _host_limit(context_len: int, prefill_ar: int, decode_ar: int) -> tuple[int, int, int]:
    # (longest prompt, positions in use, new tokens beyond them - P): a decode call of AR tokens (a lookahead
    # export's) needs AR - 1 free slots after the cache, so AR - 1 positions of the context stay unused.
    usable = context_len - decode_ar + 1
    return usable, usable, 1


def _runner_limit(context_len: int, prefill_ar: int, decode_ar: int) -> tuple[int, int, int]:
    return context_len - prefill_ar, context_len if decode_ar == 1 else context_len - decode_ar + 1, 0


_PROMPT_LIMIT = {"host": _host_limit, "runner": _runner_limit, "adb": _runner_limit}


@dataclass(frozen=True)
class Limits:
    """The token limits of one variant on one backend kind (see the module's docstring for the rule)."""

    kind: str
    context_len: int
    max_prompt: int
    extra: int  # new tokens the backend makes beyond C - P (the host's last token is never fed back)
    usable: int = 0  # positions of the context a generation can use (0: all of them)

    @classmethod
    def of(cls, contract: Any, device: str) -> "Limits":
        """``contract``: a `RunnerContract` (or anything with ``context_len`` and ``methods``); ``device``: a backend
        kind or a device name (``host``, ``runner``, ``adb``, ``adb:SERIAL``)."""
        kind = str(device).split(":", 1)[0]
        if kind not in _PROMPT_LIMIT:
            raise ValueError(f"Unknown backend kind {kind!r}; expected one of: {', '.join(_PROMPT_LIMIT)}")
        ars = {m.name: m.ar_len for m in contract.methods}
        prefill_ar = ars.get(PREFILL_METHOD, min(ars.values()))
        decode_ar = ars.get(DECODE_METHOD, 1)
        max_prompt, usable, extra = _PROMPT_LIMIT[kind](contract.context_len, prefill_ar, decode_ar)
        return cls(kind, contract.context_len, max_prompt, extra, usable)

    def room(self, prompt_len: int) -> int:
        """How many new tokens can follow a prompt of ``prompt_len`` tokens (0 when it does not fit)."""
        return max(0, (self.usable or self.context_len) - prompt_len + self.extra) if prompt_len <= self.max_prompt else 0

    def default_max_new_tokens(self, prompt_len: int) -> int:
        """`DEFAULT_MAX_NEW_TOKENS`, never more than `room`."""
        return min(DEFAULT_MAX_NEW_TOKENS, self.room(prompt_len))

    def check_prompt(self, prompt_len: int) -> None:
        """Raise `ContextOverflowError` when a prompt of ``prompt_len`` tokens does not fit."""
        if prompt_len > self.max_prompt:
            where = "" if self.kind == "host" else " (ExecuTorch's runner prefills into C - AR cache slots)"
            raise ContextOverflowError(
                f"The prompt has {prompt_len} tokens but the exported context holds {self.context_len} and takes a "
                f"prompt of at most {self.max_prompt}{where}; shorten it or export with a larger --max-seq-len"
            )


def limits_of(model: Any) -> Limits:
    """The `Limits` of a loaded `QNNModelForCausalLM` on the backend it runs on."""
    return Limits.of(model.contract, model.device_name)
