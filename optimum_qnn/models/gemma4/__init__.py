"""Gemma4 text decoders (transformers 5.23.0) as static, QNN-friendly graphs. Importing registers the swaps."""

from optimum_qnn.models.gemma4 import modules  # noqa: F401  (registers the swaps)
from optimum_qnn.models.gemma4 import vision  # noqa: F401  (registers the vision tower's swaps)
from optimum_qnn.models.gemma4.modeling import StaticCausalLM
from optimum_qnn.models.gemma4.assistant import StaticDrafter  # noqa: E402  (registers the assistant's swaps)

__all__ = ["StaticCausalLM", "StaticDrafter"]
