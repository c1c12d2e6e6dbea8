"""Gemma 4's assistant (MTP drafter) as a static graph beside its target: see docs/assistant.md.

Mirrors transformers 5.23.0 ``models/gemma4_assistant/modeling_gemma4_assistant.py`` (Gemma4AssistantForCausalLM,
Gemma4AssistantMaskedEmbedder). The drafter's decoder layers are Gemma4TextDecoderLayer in their KV-reusing form,
so the target's own twins (modules.py) serve them unchanged; only the wrapper around them is new here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.gemma4_assistant import modeling_gemma4_assistant as hf

from optimum_qnn.contract import AttentionKind, LayerSpec, MethodSpec, draft_method
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.models.gemma4.modeling import StaticCausalLM, check_adoption
from optimum_qnn.models.gemma4.modules import gemma4_layer_specs
from optimum_qnn.ops.attention import matmul_operand
from optimum_qnn.ops.mask import draft_mask
from optimum_qnn.ops.sparse_logits import clustered_logits
from optimum_qnn.swap import SWAPS, SwapContext, SwapReport, apply_swaps

logger = logging.getLogger(__name__)

_KINDS = (AttentionKind.FULL, AttentionKind.SLIDING)
_FIX = "pass the assistant trained for this target (e.g. google/gemma-4-e2b-it-assistant beside google/gemma-4-e2b-it)"


def buildable_assistant_config(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` (a `Gemma4AssistantConfig`) made buildable by transformers 5.23.0, in place.

    Its text config reuses K/V in every layer, and 5.23.0's ``Gemma4TextConfig.kv_sharing_modes`` raises when no layer
    produces a cache ("The set of layer types producing a cache is different..."), so `Gemma4AssistantForCausalLM`
    cannot be built as shipped. This one instance answers ``"reuse"`` for every layer (through its own
    ``attribute_map``, which `PretrainedConfig.__getattribute__` reads first); the class stays untouched. The two
    keys it adds are serialized by ``save_pretrained`` (and read back as the same override): keep the checkpoint's
    own config.json where one is published.
    """
    text = config.get_text_config()
    modes = ["reuse"] * text.num_hidden_layers
    text.__dict__["drafter_kv_sharing_modes"] = modes
    text.__dict__["attribute_map"] = {**type(text).attribute_map, "kv_sharing_modes": "drafter_kv_sharing_modes"}
    return config


def drafter_sources(target_layers: tuple[LayerSpec, ...]) -> dict[AttentionKind, LayerSpec]:
    """The target layers whose K/V the drafter reads: per attention kind, the last one that owns a cache (the
    ``"store"`` layers of ``kv_sharing_modes``, whose K/V transformers hands over as ``shared_kv_states``)."""
    sources: dict[AttentionKind, LayerSpec] = {}
    for layer in target_layers:
        if layer.owns_cache:
            sources[layer.attention] = layer
    return sources


def check_assistant_ties(assistant: PretrainedConfig, target: PretrainedConfig, *, assistant_name: str = "the assistant",
                         target_name: str = "the target") -> None:
    """Refuse an assistant that cannot read ``target``: every value that ties the two must match (from configs alone).

    Raises:
        InvalidInputError: naming the value, both sides and the fix.
    """
    text = assistant.get_text_config()

    def refuse(what: str, asst_value: object, target_value: object) -> InvalidInputError:
        return InvalidInputError(
            f"The assistant {assistant_name} does not fit the target {target_name}: its {what} is {asst_value}, the "
            f"target's is {target_value}. {_FIX[0].upper()}{_FIX[1:]}"
        )

    if text.vocab_size != target.vocab_size:
        raise refuse("vocabulary (text_config.vocab_size)", text.vocab_size, target.vocab_size)
    if assistant.backbone_hidden_size != target.hidden_size:
        raise refuse("backbone_hidden_size (the target hidden size it reads)", assistant.backbone_hidden_size,
                     target.hidden_size)
    sources = drafter_sources(gemma4_layer_specs(target))
    for kind in _KINDS:
        if kind not in sources:
            raise InvalidInputError(
                f"The target {target_name} has no cache-owning {kind.value} layer, and Gemma 4's assistant reads the "
                f"K/V of one of each kind. {_FIX[0].upper()}{_FIX[1:]}"
            )
    for i, layer_type in enumerate(text.layer_types):
        src = sources.get(AttentionKind(layer_type))
        if src is None:
            raise InvalidInputError(f"The assistant {assistant_name} has a layer of type {layer_type!r}; expected "
                                    f"one of: {', '.join(k.value for k in _KINDS)}")
        layer = text.per_layer_config[i]
        mine, theirs = (layer.head_dim, layer.num_key_value_heads), (src.head_dim, src.kv_heads)
        if mine != theirs:
            raise refuse(f"layer {i} ({layer_type}) (head_dim, KV heads)", mine,
                         f"{theirs} (layer {src.index}, whose K/V it reads)")


class StaticMaskedEmbedder(nn.Module):
    """Gemma4AssistantMaskedEmbedder: logits of the ``centroid_intermediate_top_k`` best clusters' tokens only."""

    def __init__(self, module: hf.Gemma4AssistantMaskedEmbedder):
        super().__init__()
        self.centroids = module.centroids
        self.register_buffer("token_ordering", module.token_ordering)
        self.top_k = module.centroid_intermediate_top_k

    def forward(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return clustered_logits(hidden, self.centroids.weight, self.token_ordering, table, self.top_k)


@SWAPS.register(hf.Gemma4AssistantMaskedEmbedder)
def _swap_masked_embedder(module: hf.Gemma4AssistantMaskedEmbedder, ctx: SwapContext) -> StaticMaskedEmbedder:
    return StaticMaskedEmbedder(module)


@dataclass(frozen=True)
class DrafterOptions:
    """Build options of the drafter's twins: the static context (RoPE tables) and the target's input embedding."""

    max_context_len: int
    target_embedding: nn.Module


# The class is its own factory: it is built from the Hugging Face module and the swap context.
@SWAPS.register(hf.Gemma4AssistantForCausalLM)
class StaticGemma4Assistant(nn.Module):
    """One drafter step: ``forward(tokens, hidden, atten_mask, sliding_atten_mask, input_pos, k_full, k_sliding,
    v_full, v_sliding)`` returns ``(logits, hidden_out)`` (`contract.draft_method`)."""

    def __init__(self, model: hf.Gemma4AssistantForCausalLM, ctx: SwapContext):
        super().__init__()
        text = model.model
        self.kinds = [AttentionKind(t) for t in text.config.layer_types]
        # The target's scaled lookup (sqrt of the target's width): the drafter's own embed_tokens is only lm_head's tie.
        self.embed_tokens = ctx.options.target_embedding
        self.pre_projection = model.pre_projection
        # Gemma4TextModel itself is not swapped: its factory builds a target (embedding, PLE, caches); its children are.
        self.layers = nn.ModuleList([ctx.swap(layer, f"model.layers.{i}") for i, layer in enumerate(text.layers)])
        self.norm = ctx.swap(text.norm, "model.norm")
        self.rope = ctx.swap(text.rotary_emb, "model.rotary_emb")
        self.post_projection = model.post_projection
        self.lm_head = model.lm_head
        self.masked_embedding = ctx.swap(model.masked_embedding, "masked_embedding")

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        atten_mask: torch.Tensor,
        sliding_atten_mask: torch.Tensor,
        input_pos: torch.Tensor,
        k_full: torch.Tensor,
        k_sliding: torch.Tensor,
        v_full: torch.Tensor,
        v_sliding: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.pre_projection(torch.cat([self.embed_tokens(tokens), hidden], dim=-1))
        rope = {kind: self.rope(input_pos, kind) for kind in dict.fromkeys(self.kinds)}
        masks = {AttentionKind.FULL: atten_mask, AttentionKind.SLIDING: sliding_atten_mask}
        # The caches are graph inputs in the target's uint16 encodings (docs/assistant.md#export).
        kv = {AttentionKind.FULL: (matmul_operand(k_full), matmul_operand(v_full)),
              AttentionKind.SLIDING: (matmul_operand(k_sliding), matmul_operand(v_sliding))}
        for kind, layer in zip(self.kinds, self.layers):
            cos, sin = rope[kind]
            h = layer(h, None, cos, sin, masks[kind], *kv[kind])[0]
        h = self.norm(h)
        if self.masked_embedding is not None:
            logits = self.masked_embedding(h, self.lm_head.weight)
        else:
            logits = self.lm_head(h)
        return logits, self.post_projection(h)


class StaticDrafter:
    """A Gemma 4 assistant as one static drafter step beside a `StaticCausalLM` target.

    Example:

    ```python
    >>> target = StaticCausalLM.from_hf(hf_target, max_context_len=128, ar_len=16)
    >>> drafter = StaticDrafter.from_hf(hf_assistant, target)
    >>> logits, hidden_out = drafter.module(*inputs)  # in the order of drafter.method.inputs
    ```
    """

    def __init__(self, module: StaticGemma4Assistant, method: MethodSpec, target: StaticCausalLM, window: int,
                 report: SwapReport):
        self.module = module
        self.method = method
        self.target = target
        self.window = window
        self.report = report

    @classmethod
    def from_hf(cls, assistant: nn.Module, target: StaticCausalLM) -> "StaticDrafter":
        """Swap a `Gemma4AssistantForCausalLM` into static modules reading ``target``'s caches.

        Args:
            assistant: the Hugging Face drafter (built from `buildable_assistant_config`); not modified, its
                parameters are adopted.
            target: the static target; its contract gives the caches' names and shapes, its embedding the lookup.

        Raises:
            InvalidInputError: the assistant does not fit the target (`check_assistant_ties`), or its window does not
                fit the target's ring caches.
        """
        if not isinstance(assistant, hf.Gemma4AssistantForCausalLM):
            raise InvalidInputError(f"assistant must be a Gemma4AssistantForCausalLM; got {type(assistant).__name__}")
        check_assistant_ties(assistant.config, target.text_config)
        contract = target.contract
        window = assistant.config.get_text_config().sliding_window
        if contract.ring_len is not None and window > contract.ring_len:
            raise InvalidInputError(
                f"The assistant's sliding window {window} is wider than the target's ring caches ({contract.ring_len} "
                "slots): export the target with the full cache layout"
            )
        embedding = target.module.model.embed_tokens
        options = DrafterOptions(contract.context_len, embedding)
        module, report = apply_swaps(assistant, SWAPS, options)
        module.eval()
        check_adoption(assistant, module, borrowed=embedding)
        hidden = assistant.config.backbone_hidden_size
        method = draft_method(contract, drafter_sources(contract.layers), hidden)
        logger.info("Swapped %d assistant modules:\n%s", len(report.swapped), report.table())
        return cls(module, method, target, window, report)

    def masks(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full and sliding masks of a drafter step at ``position`` (the target's K/V of ``[0, position)``), over
        the target decode method's cache slots (``C - ar``: fewer than ``C - 1`` when it verifies several tokens)."""
        c = self.target.contract
        columns = self.method.inputs[2].shape[-1] + 1  # draft_mask's "context": the slots and the step's own column
        full = draft_mask(columns, position)
        sliding = draft_mask(columns, position, window=self.window, ring_len=c.ring_len)
        return torch.from_numpy(full), torch.from_numpy(sliding)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Inputs of one step at position 1 with zero caches, in the order of ``self.method``."""
        full, sliding = self.masks(1)
        given = {"atten_mask": full, "sliding_atten_mask": sliding, "input_pos": torch.ones(1, 1, dtype=torch.int32)}
        return tuple(given.get(t.name, torch.zeros(t.shape, dtype=getattr(torch, t.dtype))) for t in self.method.inputs)
