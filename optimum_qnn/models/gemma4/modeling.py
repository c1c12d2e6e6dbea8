"""`StaticCausalLM`: a Hugging Face Gemma4 model turned into the static graph of the runner contract."""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import PretrainedConfig

from optimum_qnn.contract import (
    DECODE_METHOD, PREFILL_METHOD, CacheLayout, RunnerContract, check_block_len, check_ring,
)
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.models.gemma4.modules import StaticGemma4ForCausalLM, StaticOptions, gemma4_layer_specs
from optimum_qnn.session import KVSession, torch_method
from optimum_qnn.swap import SWAPS, SwapError, SwapReport, apply_swaps

logger = logging.getLogger(__name__)


class StaticCausalLM:
    """A static Gemma4 causal LM: one module instance serving the decode (ar_len 1) and prefill (ar_len N) methods.

    Example:

    ```python
    >>> from transformers import Gemma4ForCausalLM
    >>> from optimum_qnn import StaticCausalLM
    >>> static = StaticCausalLM.from_hf(hf_model, max_context_len=128, ar_len=16)
    >>> static.generate(input_ids, max_new_tokens=32)
    ```
    """

    def __init__(self, module: StaticGemma4ForCausalLM, contract: RunnerContract, report: SwapReport, text_config):
        self.module = module
        self.contract = contract
        self.report = report
        self.text_config = text_config

    @classmethod
    def from_hf(
        cls, hf_model: nn.Module, *, max_context_len: int, ar_len: int | None = None, quantized: bool = False,
        cache_layout: CacheLayout = CacheLayout.FULL, hidden_output: bool = False, decode_ar_len: int = 1,
        block_len: int | None = None, image_inputs: bool = False,
    ) -> "StaticCausalLM":
        """Swap a `Gemma4ForCausalLM` (or the text decoder of a `Gemma4ForConditionalGeneration`) into static modules.

        Args:
            hf_model: the Hugging Face model; it is not modified, and its parameters are adopted, not copied.
            max_context_len: C, the static context of every method.
            ar_len: tokens per prefill call; None or 1 gives a decode-only (``kv``) contract.
            quantized: build the graph for PT2E quantization (a few ops take another, equivalent form that the
                HTP computes correctly when quantized; see ``ops/softcap.py``).
            cache_layout: ``CacheLayout.RING`` gives sliding layers caches of ``sliding_window`` slots (a ring); the
                full layout, which ExecuTorch's C++ runner reads, gives every cache ``C - ar``.
            hidden_output: every method also returns the final hidden state ``hidden`` ``[1, ar, hidden_size]``
                (after the norm), last: what a Gemma 4 assistant beside the target reads (docs/assistant.md).
            decode_ar_len: tokens per decode call: 1, or a lookahead export's AR (`optimum_qnn.lookahead`). Its graph
                gets no window band: the host's tree mask applies the window by position.
            block_len: with ``CacheLayout.BLOCKS``, the slots per cache block (the exporter chooses it from the
                target's VTCM, `exporter.htp_limits.block_len_for`).
            image_inputs: the methods also take soft tokens, an image's embeddings (`contract.IMAGE_INPUTS`),
                merged as `Gemma4ForConditionalGeneration` merges them; the prefill reads them (needs ``ar_len`` above
                1), decode gets zeros.

        Returns:
            The static model; ``.contract`` describes the IO of its methods.
        """
        if not isinstance(getattr(hf_model, "config", None), PretrainedConfig):
            raise InvalidInputError(
                f"hf_model must be a Hugging Face Gemma4 model (load_text_model(folder) or Gemma4ForCausalLM."
                f"from_pretrained); got {type(hf_model).__name__}"
            )
        text_config = hf_model.config.get_text_config()
        max_pos = text_config.max_position_embeddings
        if isinstance(max_context_len, bool) or not isinstance(max_context_len, int) or max_context_len < 2:
            raise InvalidInputError(f"max_context_len must be an integer >= 2, e.g. 1024; got {max_context_len!r}")
        if max_context_len > max_pos:
            raise InvalidInputError(
                f"max_context_len {max_context_len} exceeds the model's max_position_embeddings {max_pos}; choose at most {max_pos}"
            )
        if ar_len is not None and (isinstance(ar_len, bool) or not isinstance(ar_len, int) or not 1 <= ar_len < max_context_len):
            raise InvalidInputError(
                f"ar_len must be an integer in [1, {max_context_len - 1}] (below max_context_len), or None for decode "
                f"only; got {ar_len!r}"
            )
        ar_lens = {DECODE_METHOD: decode_ar_len}
        if ar_len is not None and ar_len > 1:
            ar_lens = {PREFILL_METHOD: ar_len, DECODE_METHOD: decode_ar_len}
        if image_inputs and PREFILL_METHOD not in ar_lens:
            raise InvalidInputError("Soft tokens (an image's embeddings) enter through the prefill method: give ar_len > 1")
        cache_layout = CacheLayout.parse(cache_layout)
        window = text_config.sliding_window if "sliding_attention" in text_config.layer_types else None
        try:  # before the swap: a ring that cannot help is refused before any module is built
            ring = check_ring(cache_layout, gemma4_layer_specs(text_config), max_context_len, window)
            check_block_len(cache_layout, block_len)
        except ValueError as e:
            raise InvalidInputError(str(e)) from None
        options = StaticOptions(max_context_len=max_context_len, quantized=quantized,
                                ar_lens=tuple(ar for ar in ar_lens.values() if decode_ar_len == 1 or ar != decode_ar_len),
                                ring_len=ring, hidden_output=hidden_output, block_len=block_len,
                                image_inputs=image_inputs)
        module, report = apply_swaps(hf_model, SWAPS, options)
        module.eval()
        check_adoption(hf_model, module)
        contract = RunnerContract.build(
            module.layer_specs,
            vocab_size=text_config.vocab_size,
            context_len=max_context_len,
            ar_lens=ar_lens,
            sliding_window=window,
            cache_layout=cache_layout,
            hidden_size=text_config.hidden_size if hidden_output else None,
            block_len=block_len,
            image_size=text_config.hidden_size if image_inputs else None,
        )
        logger.info("Swapped %d modules:\n%s", len(report.swapped), report.table())
        return cls(module, contract, report, text_config)

    def example_inputs(self, method: str | None = None) -> tuple[torch.Tensor, ...]:
        """The contract's example inputs for ``method`` (default: the first method, prefill when present)."""
        return self.contract.example_inputs(method or self.contract.methods[0].name)

    def export(self, method: str, inputs: tuple[torch.Tensor, ...] | None = None) -> torch.export.ExportedProgram:
        """``torch.export`` the module with ``method``'s shapes (``inputs``: its example inputs, made here if None).

        Non-strict: the module is ours (pure tensor code, caches are inputs), and strict (TorchDynamo) tracing held
        a transient second copy of every weight: at Gemma-4-E2B widths with 7 layers the export stage peaked at
        12.4 GB RSS from 5.6 GB before it; non-strict tracing adds nothing.
        """
        return torch.export.export(self.module, self.example_inputs(method) if inputs is None else inputs, strict=False)

    def session(self) -> KVSession:
        """A KV session that runs this module eagerly, method by method, as a device runner would."""

        return KVSession(self.contract, {m.name: torch_method(self.module) for m in self.contract.methods})

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None) -> torch.Tensor:
        """Greedy generation: prefill in ar_len chunks, then decode one token per call.

        Args:
            input_ids: ``[1, T]`` or ``[T]`` prompt ids.
            max_new_tokens: tokens to generate (fewer if an EOS id is produced or the context is full).
            eos_token_id: stop ids.

        Returns:
            ``[1, T + n]`` prompt followed by the generated ids.
        """
        return greedy_generate(self.session(), input_ids, max_new_tokens, eos_token_id)


def greedy_generate(session: KVSession, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    prompt = input_ids.reshape(-1)
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    logits = session.feed(prompt)
    out = prompt.tolist()
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits[-1]))
        out.append(token)
        if token in eos or step == max_new_tokens - 1 or session.n_past >= session.capacity:
            break
        logits = session.feed(torch.tensor([token]))
    return torch.tensor(out, dtype=torch.long).unsqueeze(0)


def check_adoption(hf_model: nn.Module, static: nn.Module, borrowed: nn.Module | None = None) -> None:
    """nanoGPT-style strict check: every text-decoder parameter of ``hf_model`` is used by ``static`` as is.

    Parameters outside the text decoder (vision/audio towers of a multimodal model) are not expected. ``borrowed``
    is a module of another model that ``static`` uses too (a drafter reads its target's embedding).
    """
    static_ids = {id(p) for p in static.parameters()}
    missing = [
        name
        for name, p in hf_model.named_parameters()
        if id(p) not in static_ids and not _outside_text_decoder(name)
    ]
    if missing:
        raise SwapError(f"{len(missing)} Hugging Face parameters were not adopted by the static model: {missing[:8]}")
    hf_ids = {id(p) for p in hf_model.parameters()} | {id(p) for p in (borrowed.parameters() if borrowed else ())}
    extra = [name for name, p in static.named_parameters() if id(p) not in hf_ids]
    if extra:
        raise SwapError(f"The static model has parameters that are not the Hugging Face ones: {extra[:8]}")


def _outside_text_decoder(name: str) -> bool:
    return name.startswith(("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio."))
