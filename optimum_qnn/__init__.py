"""optimum-qnn: export Hugging Face Gemma4 text models to Qualcomm Hexagon NPUs through ExecuTorch's QNN backend.

Importing this package is cheap: torch, executorch and the QNN libraries load only when a public object that
needs them is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0.dev0"

_LAZY = {
    "StaticCausalLM": "optimum_qnn.models.gemma4",
    "ExportConfig": "optimum_qnn.config",
    "QuantScheme": "optimum_qnn.config",
    "Soc": "optimum_qnn.config",
    "ExportMode": "optimum_qnn.config",
    "ensure_qnn_sdk": "optimum_qnn.sdk",
    # The runtime imports torch (0.9 s measured): loaded on first use, so `optimum-cli --help` stays fast.
    "QNNModelForCausalLM": "optimum_qnn.runtime.modeling",
    "QNNModelForImageTextToText": "optimum_qnn.runtime.images",
    "QNNProcessor": "optimum_qnn.runtime.transformers_api.processor",
    "export": "optimum_qnn.exporter.pipeline",
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from optimum_qnn.config import ExportConfig, ExportMode, QuantScheme, Soc
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.runtime.images import QNNModelForImageTextToText
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM
    from optimum_qnn.runtime.transformers_api.processor import QNNProcessor
    from optimum_qnn.models.gemma4.modeling import StaticCausalLM
    from optimum_qnn.sdk import ensure_qnn_sdk


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'optimum_qnn' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
