"""`generate(**tokenizer(...))` with transformers' semantics, on any backend, over the project's one-row generation.

A batch runs row by row: each row's left padding (its ``attention_mask`` zeros) is stripped before the row is run and
put back in the output; rows that end early are filled with ``pad_token_id`` to the longest, as transformers pads
finished rows. ``num_return_sequences`` sampled rows run one after another. A row's tokens are chosen by a
`choosing.RowChooser` (transformers' processors and sampler where transformers is importable) on the in-process
backends; a backend that chooses its own tokens (ExecuTorch's C++ runner) takes what it can honour, and anything else
is refused by name.

A model class uses this by having ``generate_tokens(ids, max_new_tokens=..., sampling=..., eos_token_id=...,
streamer=..., cancel=..., reuse_cache=..., speculative=..., **row_inputs)`` (one unpadded row in, ``[1, prompt + new]``
out), a ``backend`` and ``generation_defaults()``; ``row_inputs`` names the model inputs besides the ids that it takes
per row (an image model's pixel values), each split along the batch dimension.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Collection

import numpy as np

from optimum_qnn.errors import InvalidInputError, UnsupportedParameterError
from optimum_qnn.ops.arrays import as_numpy, is_torch, like
from optimum_qnn.runtime.generation import Sampling, check_generate_args, prompt_ids
from optimum_qnn.runtime.transformers_api.choosing import RowChooser, torch_available
from optimum_qnn.runtime.transformers_api.options import GLOBAL_DEFAULTS, HONOURED, NEUTRAL, GenerateOptions, resolve

logger = logging.getLogger(__name__)

# GenerationConfig fields the options refuse by name when set (the rest of transformers 5.23.0's generation fields);
# a keyword in none of these sets is not a generation option at all.
_OTHER_FIELDS = frozenset({
    "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff", "guidance_scale", "low_memory", "penalty_alpha",
    "dola_layers", "bad_words_ids", "force_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
    "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty", "renormalize_logits",
    "watermarking_config", "output_attentions", "output_hidden_states", "prompt_lookup_num_tokens",
    "max_matching_ngram_size", "token_healing", "constraints", "assistant_early_exit", "target_lookbehind",
    "assistant_lookbehind", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
})
# generate()'s own arguments that the NPU program cannot take, with what to do instead.
_REFUSED_ARGUMENTS = {
    "assistant_model": "pass speculative='assistant' (a variant exported with --assistant drafts on the NPU)",
    "assistant_tokenizer": "pass speculative='assistant' (a variant exported with --assistant drafts on the NPU)",
    "prefix_allowed_tokens_fn": "pass a logits_processor that masks the disallowed tokens",
    "negative_prompt_ids": "classifier-free guidance needs a second sequence per call",
    "negative_prompt_attention_mask": "classifier-free guidance needs a second sequence per call",
    "custom_generate": "the generation loop runs in optimum-qnn's backends",
    "inputs_embeds": "the exported program takes token ids",
    "past_key_values": "the backend keeps its own caches (reuse_cache=True reuses them)",
    "position_ids": "the backend numbers positions itself",
    "cache_position": "the backend numbers positions itself",
}


def hf_generate(model: Any, input_ids: Any = None, attention_mask: Any = None, generation_config: Any = None, *,
                streamer: Any = None, tokenizer: Any = None, logits_processor: Any = None,
                stopping_criteria: Any = None, generator: Any = None, reuse_cache: bool = False,
                cancel: Callable[[], bool] | None = None, speculative: str | None = None,
                row_inputs: Collection[str] = (), **kwargs: Any) -> Any:
    """The body of a model's `generate` (see the module docstring); returns what transformers' ``generate`` returns."""
    if input_ids is None:
        input_ids = kwargs.pop("inputs", None)
    if input_ids is None:
        raise InvalidInputError("generate needs input_ids (e.g. model.generate(**tokenizer(text, return_tensors='pt')))")
    extra = {name: kwargs.pop(name) for name in list(kwargs) if name in row_inputs}
    _refuse_arguments(kwargs)
    if kwargs.pop("synced_gpus", None):
        raise UnsupportedParameterError("generate(synced_gpus=True): the model runs on one NPU; drop synced_gpus",
                                        param="synced_gpus", backend="optimum-qnn")
    options = resolve(model.generation_defaults(), generation_config, kwargs)
    check_generate_args(options.max_new_tokens or 0, options.do_sample, options.temperature, options.top_k,
                        options.top_p, streamer, generator, cancel)
    rows, pads, padded_len = _rows(input_ids, attention_mask)
    use_torch = torch_available() and not isinstance(generator, np.random.Generator)
    processors, criteria = list(logits_processor or []), list(stopping_criteria or [])
    if (processors or criteria) and not use_torch:
        raise InvalidInputError("logits_processor and stopping_criteria are transformers objects: they need transformers "
                                "and torch installed (and generator a torch.Generator or None)")
    if options.stop_strings and tokenizer is None:
        raise InvalidInputError(f"stop_strings={list(options.stop_strings)!r} needs the tokenizer: pass tokenizer=")
    chooses = bool(getattr(model.backend, "applies_logits", False))
    _refuse_what_the_backend_cannot(options, model, chooses, speculative, processors, generator)
    n = options.num_return_sequences
    if streamer is not None and len(rows) * n != 1:
        raise InvalidInputError(f"a streamer takes one sequence; this call makes {len(rows) * n} (a batch of "
                                f"{len(rows)}, num_return_sequences={n}): stream one prompt at a time")
    if streamer is not None:  # transformers hands a streamer the input first (TextStreamer skips it if asked)
        streamer.put(input_ids if is_torch(input_ids) else np.asarray(input_ids, dtype=np.int64))
    outputs: list[tuple[list[int], RowChooser]] = []
    for r, row in enumerate(rows):
        row_extra = {k: v[r: r + 1] for k, v in extra.items()}
        for _ in range(n):
            chooser = RowChooser(options, row, pads[r], use_torch=use_torch, generator=generator,
                                 logits_processor=processors, stopping_criteria=criteria, tokenizer=tokenizer)
            new = _run_row(model, row, options, padded_len, chooser, chooses, streamer, cancel, reuse_cache,
                           speculative, generator, use_torch, row_extra)
            outputs.append((new, chooser))
    return _assemble(input_ids, rows, pads, outputs, options, use_torch)


def _refuse_arguments(kwargs: dict[str, Any]) -> None:
    """generate()'s arguments the program cannot take, and keywords that are no option at all."""
    for name, instead in _REFUSED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedParameterError(f"generate({name}=...) cannot run on the NPU program; {instead}",
                                            param=name, backend="optimum-qnn")
        kwargs.pop(name, None)
    known = set(GLOBAL_DEFAULTS) | HONOURED | NEUTRAL | _OTHER_FIELDS | {"synced_gpus"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InvalidInputError(
            f"generate() got unexpected keyword argument(s): {', '.join(unknown)}; it takes input_ids, attention_mask, "
            "generation_config and its fields (max_new_tokens, do_sample, ...), streamer, tokenizer, logits_processor, "
            "stopping_criteria, and optimum-qnn's generator, reuse_cache, cancel, speculative"
        )


def _rows(input_ids: Any, attention_mask: Any) -> tuple[list[list[int]], list[int], int]:
    """Each row's ids without its left padding, how much padding each had, and the padded length."""
    if isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(r, (list, tuple)) for r in input_ids):
        batch = list(input_ids)  # a list of rows (its lengths may differ: checked below)
    elif not isinstance(input_ids, (str, bytes)) and np.ndim(as_numpy(input_ids)) == 2:
        batch = list(input_ids)
    else:
        batch = [input_ids]  # one row (`prompt_ids` says what is wrong with anything else)
    rows = [prompt_ids(row).tolist() for row in batch]
    if attention_mask is None:
        if len({len(r) for r in rows}) > 1:
            raise InvalidInputError("input_ids rows of different lengths need padding and an attention_mask "
                                    "(tokenizer(texts, padding=True, return_tensors='pt'))")
        return rows, [0] * len(rows), len(rows[0])
    mask = as_numpy(attention_mask)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != (len(rows), len(rows[0])):
        raise InvalidInputError(f"attention_mask has shape {tuple(mask.shape)}; input_ids has "
                                f"{(len(rows), len(rows[0]))}: pass the tokenizer's own mask")
    pads = []
    for r, row_mask in enumerate(mask.astype(bool)):
        pad = int(np.argmax(row_mask)) if row_mask.any() else len(row_mask)
        if pad == len(row_mask) or not row_mask[pad:].all():
            raise InvalidInputError(
                f"attention_mask row {r} is {row_mask.astype(int).tolist()}: a decoder-only model takes left padding "
                "(ones after the zeros, at least one one); set tokenizer.padding_side = 'left'"
            )
        pads.append(pad)
    return [row[p:] for row, p in zip(rows, pads)], pads, len(rows[0])


def _refuse_what_the_backend_cannot(options: GenerateOptions, model: Any, chooses: bool, speculative: str | None,
                                    processors: list, generator: Any) -> None:
    """Options the backend or the speculative decoding would otherwise ignore: refused by name."""
    where = f"the {model.backend.name} backend" if not chooses else f"speculative={speculative!r}"
    if chooses and speculative is None:
        return
    sampled = options.do_sample
    given = [
        ("repetition_penalty", options.repetition_penalty != 1.0, "1.0"),
        ("min_new_tokens", options.min_new_tokens or options.min_length, "0 (and min_length 0)"),
        ("logits_processor", bool(processors), "None"),
        ("output_scores", options.output_scores or options.output_logits, "False (and output_logits False)"),
    ]
    if not chooses:  # ExecuTorch's runner samples with a temperature only, seeded by itself
        given += [("top_k", sampled and options.top_k not in (None, 0), "0 (transformers' default is 50)"),
                  ("top_p", sampled and options.top_p not in (None, 1.0), "1.0"),
                  ("generator", sampled and generator is not None, "None")]
    for name, active, neutral in given:
        if not active:
            continue
        why = ("ExecuTorch's runner samples with a temperature only" if not chooses
               else "its drafts and verification choose tokens without it")
        raise UnsupportedParameterError(
            f"{name} cannot be applied on {where}: {why}; pass {name}={neutral}, or generate on a host device "
            "without speculative decoding", param=name, backend=where,
        )


def _run_row(model: Any, row: list[int], options: GenerateOptions, padded_len: int, chooser: RowChooser,
             chooses: bool, streamer: Any, cancel: Any, reuse_cache: bool, speculative: str | None, generator: Any,
             use_torch: bool, row_extra: dict[str, Any]) -> list[int]:
    """One row's new tokens, cut at its stopping criteria."""
    if chooses and speculative is None:
        sampling: Any = chooser
    else:
        if generator is None and use_torch and options.do_sample and chooses:  # (a runner seeds itself)
            import torch

            generator = torch.default_generator  # seeded by torch.manual_seed, as transformers' sampling is
        top_k = options.top_k or None
        sampling = Sampling(options.do_sample, options.temperature, top_k, options.top_p, generator)
    streams = streamer is not None and bool(getattr(model.backend, "streams", False))

    criteria_hit = []

    def stop() -> bool:
        if cancel is not None and cancel():
            return True
        if chooser.stopped():
            criteria_hit.append(True)
            return True
        return False

    out = model.generate_tokens(
        row, max_new_tokens=options.new_tokens(padded_len), sampling=sampling, eos_token_id=options.eos_token_id,
        streamer=streamer if streams else None, cancel=stop if chooses else cancel, reuse_cache=reuse_cache,
        speculative=speculative, **row_extra,
    )
    generated = as_numpy(out)[0, len(row):].tolist()
    new = chooser.cut(generated)
    if criteria_hit or len(new) < len(generated):  # a stopping criterion ended it, not the caller's cancel
        model.stats.stopped_by = "stop_criteria"
    if streamer is not None and not streams:  # a runner's tokens come when it ends: stream the kept ones
        for token in new:
            streamer.put(np.array([token]))
        streamer.end()
    return new


def _assemble(input_ids: Any, rows: list[list[int]], pads: list[int], outputs: list, options: GenerateOptions,
              use_torch: bool) -> Any:
    """transformers' output: each row's padded input, its new tokens, then ``pad_token_id`` to the longest."""
    n = options.num_return_sequences
    longest = max(len(new) for new, _ in outputs)
    if any(len(new) < longest for new, _ in outputs) and options.pad_token_id is None:
        raise InvalidInputError("rows ended at different lengths and neither pad_token_id nor eos_token_id is set: "
                                "pass pad_token_id")
    pad_id = options.pad_token_id
    seqs = []
    for i, (new, _) in enumerate(outputs):
        r = i // n
        seqs.append([pad_id] * pads[r] + rows[r] + new + [pad_id] * (longest - len(new)))
    sequences = like(input_ids, np.asarray(seqs, dtype=np.int64))
    if not options.return_dict_in_generate:
        return sequences
    fields: dict[str, Any] = {"sequences": sequences}
    for name, wanted in (("scores", options.output_scores), ("logits", options.output_logits)):
        if wanted:
            steps = [getattr(c, name) for _, c in outputs]
            vocab = next((s[0].size for s in steps if s), 0)
            per_step = []
            for t in range(longest):  # a row that ended has no choice at this step: -inf, no token was scored
                per_step.append(np.stack([s[t] if t < len(s) else np.full(vocab, -np.inf, np.float32) for s in steps]))
            fields[name] = tuple(like(input_ids, step) for step in per_step)
    if use_torch:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(**fields)
    return GenerateOutput(**fields)


class GenerateOutput(dict):
    """``return_dict_in_generate=True`` on the runtime install (no transformers): transformers'
    ``GenerateDecoderOnlyOutput`` fields as numpy arrays, readable as attributes and as keys."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            if name in ("scores", "logits", "attentions", "hidden_states", "past_key_values"):
                return None
            raise AttributeError(name) from None
