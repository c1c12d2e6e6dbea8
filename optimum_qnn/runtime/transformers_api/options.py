"""`generate`'s options resolved as transformers resolves them, and refused where the NPU program cannot honour them.

The priority is transformers 5.23.0's (``generation/utils.py``, ``_prepare_generation_config``): keyword arguments,
then the ``generation_config`` passed, then the model's own (the checkpoint's ``generation_config.json`` the artifact
keeps), then transformers' global defaults (`GLOBAL_DEFAULTS`). It is plain dicts, so the runtime install (no
transformers) resolves the same way; a transformers ``GenerationConfig`` is read through ``to_diff_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from optimum_qnn.errors import InvalidInputError, UnsupportedParameterError

# transformers 5.23.0's `GenerationConfig._get_default_generation_params()`, the values a field unset everywhere
# takes (measured; kept here so the runtime install, which has no transformers, resolves the same).
GLOBAL_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "use_cache": True, "early_stopping": False, "num_beams": 1,
    "temperature": 1.0, "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
    "length_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "num_return_sequences": 1,
    "output_scores": False, "return_dict_in_generate": False, "remove_invalid_values": False, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4,
    "assistant_lookbehind": 10, "target_lookbehind": 10,
}

# What `generate` honours, on every backend that can (`RowChooser` applies them, in transformers' order).
HONOURED = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "eos_token_id", "pad_token_id", "stop_strings", "num_return_sequences",
    "return_dict_in_generate", "output_scores", "output_logits", "max_time",
})
# Fields that change nothing here: the caches are always used, the NPU program has its own; the ids only name tokens.
NEUTRAL = frozenset({
    "use_cache", "cache_implementation", "cache_config", "transformers_version", "_from_model_config", "bos_token_id",
    "decoder_start_token_id", "compile_config", "disable_compile", "is_assistant", "trust_remote_code",
})
# What the NPU program cannot do, with the way to get the closest thing.
_INSTEAD = {
    "num_beams": "beam search needs several hypotheses in one call; the exported program runs one sequence",
    "assistant_model": "pass speculative='assistant' with a variant exported with --assistant",
    "prompt_lookup_num_tokens": "pass speculative='lookahead' with a variant exported with --mode lookahead",
}


@dataclass(frozen=True)
class GenerateOptions:
    """The resolved options of one `generate` call (every field of `HONOURED`, with transformers' defaults)."""

    max_length: int
    max_new_tokens: int | None
    min_length: int
    min_new_tokens: int | None
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    repetition_penalty: float
    eos_token_id: list[int]
    pad_token_id: int | None
    stop_strings: tuple[str, ...]
    num_return_sequences: int
    return_dict_in_generate: bool
    output_scores: bool
    output_logits: bool
    max_time: float | None

    def new_tokens(self, padded_len: int) -> int:
        """How many tokens a row whose input (with its padding) is ``padded_len`` long may add: ``max_new_tokens``,
        else ``max_length`` minus the input, as transformers counts it (the padding included)."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return max(0, self.max_length - padded_len)

    def min_new(self, padded_len: int) -> int:
        """The new tokens before an EOS may be chosen: ``min_new_tokens``, else ``min_length`` minus the input."""
        if self.min_new_tokens is not None:
            return self.min_new_tokens
        return max(0, self.min_length - padded_len)

    @property
    def penalizes_history(self) -> bool:
        """Whether a token's choice depends on the tokens before it (which speculative decoding cannot replay)."""
        return self.repetition_penalty != 1.0


def config_dict(config: Any, what: str) -> dict[str, Any]:
    """A generation config as a dict of the fields it sets: a transformers ``GenerationConfig`` (its diff from the
    defaults), a mapping, or None."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    to_diff = getattr(config, "to_diff_dict", None)
    if callable(to_diff):
        return {k: v for k, v in to_diff().items() if v is not None}
    raise InvalidInputError(
        f"{what} must be a transformers GenerationConfig or a dict of its fields; got {type(config).__name__}"
    )


def resolve(model_config: Mapping[str, Any], generation_config: Any, kwargs: Mapping[str, Any]) -> GenerateOptions:
    """The options of one call: ``kwargs`` over ``generation_config`` over ``model_config`` over `GLOBAL_DEFAULTS`;
    a field the program cannot honour, set to other than its default, raises `UnsupportedParameterError` naming it."""
    merged = dict(GLOBAL_DEFAULTS)
    layers = (model_config, config_dict(generation_config, "generation_config"), kwargs)
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None})
    if merged.get("max_new_tokens") is None and all(layer.get("max_length") is None for layer in layers):
        # transformers' default max_length (20) counts new tokens only (``_prepare_generated_length``)
        merged["max_new_tokens"] = GLOBAL_DEFAULTS["max_length"]
    for name, value in merged.items():
        if name in HONOURED or name in NEUTRAL or value == GLOBAL_DEFAULTS.get(name) or value in (None, False, [], {}):
            continue
        why = _INSTEAD.get(name, "the exported program runs one token choice per step, without it")
        raise UnsupportedParameterError(
            f"generate({name}={value!r}) cannot run on the NPU program: {why}; drop {name}", param=name,
            backend="optimum-qnn",
        )
    n = merged["num_return_sequences"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidInputError(f"num_return_sequences must be an integer >= 1; got {n!r}")
    if n > 1 and not merged["do_sample"]:
        raise InvalidInputError(
            f"num_return_sequences={n} needs do_sample=True: greedy decoding gives the same sequence every time"
        )
    for name in ("max_length", "min_length"):
        value = merged[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInputError(f"{name} must be an integer >= 0; got {value!r}")
    min_new = merged.get("min_new_tokens")
    if min_new is not None and (isinstance(min_new, bool) or not isinstance(min_new, int) or min_new < 0):
        raise InvalidInputError(f"min_new_tokens must be an integer >= 0; got {min_new!r}")
    penalty = merged["repetition_penalty"]
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
        raise InvalidInputError(f"repetition_penalty must be a number > 0 (1.0: no penalty); got {penalty!r}")
    stops = merged.get("stop_strings") or ()
    stops = (stops,) if isinstance(stops, str) else tuple(stops)
    if not all(isinstance(s, str) and s for s in stops):
        raise InvalidInputError(f"stop_strings must be a string or a list of non-empty strings; got {stops!r}")
    eos = merged.get("eos_token_id")
    eos_list = [] if eos is None else [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if not isinstance(eos_list, (list, tuple)) or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_list):
        raise InvalidInputError(f"eos_token_id must be an int, a list of ints or None; got {eos!r}")
    pad = merged.get("pad_token_id")
    if pad is None and eos_list:
        pad = eos_list[0]  # transformers pads finished rows with the first EOS when no pad id is set
    top_k = merged["top_k"]
    return GenerateOptions(
        max_length=merged["max_length"], max_new_tokens=merged.get("max_new_tokens"),
        min_length=merged["min_length"], min_new_tokens=min_new, do_sample=merged["do_sample"],
        temperature=merged["temperature"], top_k=top_k, top_p=merged["top_p"], repetition_penalty=float(penalty),
        eos_token_id=list(eos_list), pad_token_id=pad, stop_strings=stops, num_return_sequences=n,
        return_dict_in_generate=bool(merged["return_dict_in_generate"]), output_scores=bool(merged["output_scores"]),
        output_logits=bool(merged.get("output_logits")), max_time=merged.get("max_time"),
    )
