"""Where an export's weights live: the embedding tables as CPU lookups, the float weights the quantized graphs no
longer read released, the quantized weights in a file mapping until the lowering is done.

Each step keeps the values and moves or drops memory the export would otherwise carry into its largest stages (the
lowering and its compile workers); the estimate of `optimum_qnn.exporter.memory` is fitted to exports that take them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from optimum_qnn.artifacts.writer import staging_path
from optimum_qnn.config import ExportConfig
from optimum_qnn.models.gemma4 import StaticCausalLM

logger = logging.getLogger(__name__)


def swap_embeddings_for_cpu(static: StaticCausalLM, config: ExportConfig, output: Path | None = None) -> None:
    """Replace the token and per-layer embedding tables with CPU-side (weight-only quantized) lookups; with
    ``output``, their tables then live in a file mapping on its file system (`embedding.map_tables_to_file`)."""
    from optimum_qnn.quantization.embedding import QuantizedEmbedding, map_tables_to_file

    text = static.module.model
    names = ["embed_tokens"] + (["embed_tokens_per_layer"] if text.ple_dim else [])
    lookups = []
    for name in names:
        hf_embedding = getattr(text, name)
        lookups.append(QuantizedEmbedding.from_embedding(hf_embedding, config.embedding_quant))
        setattr(text, name, ScaledLookup(lookups[-1], hf_embedding.scalar_embed_scale))
    if output is None:
        return
    moved = map_tables_to_file(lookups, staging_path(output, ".tables"))
    logger.info("Embedding tables mapped from a file: %.0f MB out of anonymous memory", moved / 2**20)


def map_weights_to_file(graphs, output: Path) -> None:
    """The quantized weights leave anonymous memory for a file mapping on the output's file system until the
    lowering is done (`folding.map_constants_to_file`)."""
    from optimum_qnn.quantization.folding import map_constants_to_file

    started = time.monotonic()
    moved = map_constants_to_file(graphs, staging_path(output, ".weights"))
    if moved:
        logger.info("Quantized weights mapped from a file: %.0f MB out of anonymous memory in %.1f s",
                    moved / 2**20, time.monotonic() - started)


def release_float_weights(module: torch.nn.Module, graphs) -> None:
    """Empty the float weights that the quantized graphs no longer read (they hold quantized copies), so lowering
    does not carry them: 7.4 GB of fp32 layer weights and 1.6 GB of lm_head for Gemma-4-E2B. The module cannot
    run afterwards."""
    from optimum_qnn.quantization.folding import tensor_attributes

    used = {t.untyped_storage().data_ptr() for graph in graphs for _, t in tensor_attributes(graph)}
    freed = 0
    for p in module.parameters():
        if p.numel() and p.untyped_storage().data_ptr() not in used:
            freed += p.nbytes
            p.data = torch.empty(0, dtype=p.dtype)
    logger.info("Released %.0f MB of float weights before lowering", freed / 2**20)


def lm_head_in_float32(static: StaticCausalLM) -> None:
    """The lm_head shares the token table, which may be loaded in its stored dtype: the HTP graph wants fp32."""
    head = static.module.lm_head
    if head.weight.dtype != torch.float32:
        head.weight = torch.nn.Parameter(head.weight.detach().to(torch.float32), requires_grad=False)


class ScaledLookup(torch.nn.Module):
    """A CPU lookup followed by Gemma4's constant embedding scale (sqrt of the width)."""

    def __init__(self, lookup: torch.nn.Module, scale: float):
        super().__init__()
        self.lookup = lookup
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids) * self.scale
