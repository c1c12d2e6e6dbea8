"""Exports only the onnxruntime backend's tests use (the shared ones live in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import built_once


@pytest.fixture(scope="session")
def asym4_kv_export(demo_model_dir, tmp_path_factory, qnn_sdk) -> Path:
    """The demo model fp16 in kv mode (context 32) with asymmetric 4-bit tables in groups of 32: the CPU side runs
    `embedding_4bit` with zero points (float32, one per group). No calibration: a cheap lowering."""
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.KV, shapes=ShapeConfig(32, 4),
                          embedding_quant=EmbeddingQuant(4, 32, symmetric=False))
    return built_once(tmp_path_factory, "asym4-kv", lambda out: export(demo_model_dir, out, config).output)
