"""Which Gemma 4 checkpoints export, and why the others do not: answered from config.json alone, before any weight.

Read against transformers 5.23.0 (models/gemma4, gemma4_unified, gemma4_assistant, gemma4_unified_assistant):

- `gemma4` / `gemma4_text` dense checkpoints (E2B, E4B, the 31B dense) use the classes the static model swaps
  (Gemma4TextDecoderLayer, Gemma4TextAttention, Gemma4TextMLP...): supported;
- the 26B-A4B Mixture-of-Experts is `gemma4` with `enable_moe_block=True`: each layer adds Gemma4TextRouter, which
  picks `top_k_experts` of `num_experts` per token, and Gemma4TextExperts, which runs only those; a static HTP graph
  has no data-dependent choice of weights, and no static twin of either exists here;
- `gemma4_unified` (the 12B) has its own decoder classes (Gemma4UnifiedTextDecoderLayer, Gemma4UnifiedTextAttention,
  Gemma4UnifiedTextMLP, Gemma4UnifiedTextRotaryEmbedding...) and a bidirectional-attention option, none of which the
  swap registry knows;
- `gemma4_assistant` / `gemma4_unified_assistant` are MTP drafters: every layer reuses the target model's K/V
  (`num_kv_shared_layers == num_hidden_layers`) and the input is the target's hidden state (`backbone_hidden_size`),
  so the drafter is not a decoder on its own: it is read beside its target (`--assistant`, models/gemma4/assistant.py).
"""

from __future__ import annotations

from pathlib import Path

from optimum_qnn.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("gemma4", "gemma4_text")
_DENSE = "a dense Gemma 4 checkpoint (google/gemma-4-e2b, google/gemma-4-e4b or the 31B dense)"

_REFUSED_TYPES = {
    "gemma4_unified": (
        "a Gemma 4 unified checkpoint (the 12B): its decoder has its own classes in transformers "
        "(Gemma4UnifiedTextDecoderLayer, Gemma4UnifiedTextAttention, Gemma4UnifiedTextMLP, "
        "Gemma4UnifiedTextRotaryEmbedding) and optional bidirectional attention, and optimum-qnn has no static, "
        "QNN-friendly twin for any of them"
    ),
    "gemma4_assistant": (
        "a Gemma 4 assistant (MTP drafter) checkpoint: every layer reuses the target model's K/V cache and its "
        "input is the target's hidden state, so it is not a decoder on its own; it goes beside its target "
        "(--assistant, docs/assistant.md)"
    ),
}
_REFUSED_TYPES["gemma4_unified_text"] = _REFUSED_TYPES["gemma4_unified"]
_REFUSED_TYPES["gemma4_unified_assistant"] = (
    "a Gemma 4 unified assistant (MTP drafter of the 12B) checkpoint: every layer reuses the target model's K/V cache "
    "and its input is the target's hidden state, and optimum-qnn has no static twin of the 12B it drafts for"
)


def check_model_type(raw: dict, path: Path) -> None:
    """Refuse a config.json whose model_type is not an exportable Gemma 4, saying what is missing and why."""
    model_type = raw.get("model_type")
    if model_type in _REFUSED_TYPES:
        raise UnsupportedModelError(
            f"{path} is {_REFUSED_TYPES[model_type]} (model_type {model_type!r}). Export {_DENSE} instead"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"Model type {model_type!r} is not supported; expected one of: {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(Gemma4 text or multimodal checkpoints)"
        )


def check_dense(config, path: Path) -> None:
    """Refuse the Mixture-of-Experts checkpoint (26B-A4B) from its text config, before any weight is read."""
    if getattr(config, "enable_moe_block", False):
        raise UnsupportedModelError(
            f"{path} is a Gemma 4 Mixture-of-Experts checkpoint (enable_moe_block=True, {config.num_experts} experts, "
            f"{config.top_k_experts} per token: the 26B-A4B): each layer's Gemma4TextRouter chooses which experts' "
            "weights a token uses, a data-dependent choice a static HTP graph cannot make, and optimum-qnn has no "
            f"static twin of Gemma4TextRouter or Gemma4TextExperts. Export {_DENSE} instead"
        )
