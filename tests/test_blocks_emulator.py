"""The blocks cache layout exported and run on the x86 HTP emulator: the same greedy tokens as the full layout,
through both in-process backends (ExecuTorch's Python runtime and onnxruntime-qnn).

The window-7 demo model (tests/conftest.py `window7_model_dir`), fp16, context 64, prefill chunks of 8, blocks forced
to 16 slots (`ShapeConfig.cache_block_len`): each full-attention cache is four inputs (16, 16, 16, 15 slots in the
decode graph; 16, 16, 16, 8 in the prefill graph), the sliding layers keep their ring of 7. The 24-token prompt spans
a block boundary and three prefill chunks; 16 generated tokens cross the next boundary.
"""

from __future__ import annotations

import pytest
import torch

from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD, CacheLayout
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
from tests.conftest import WINDOW7, WINDOW7_CTX
from tests.test_window_chunks import PROMPTS

BLOCK = 16


@pytest.fixture(scope="session")
def blocks_export(window7_model_dir, tmp_path_factory, qnn_sdk):
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    out = tmp_path_factory.mktemp("window7-blocks")
    config = ExportConfig(
        socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.HYBRID,
        shapes=ShapeConfig(WINDOW7_CTX, 8, cache_layout=CacheLayout.BLOCKS, cache_block_len=BLOCK),
        embedding_quant=EmbeddingQuant(0, 0), weight_sharing=False,
    )
    result = export(window7_model_dir, out, config)
    assert [v.relative_to(out).as_posix() for v in result.variants] == ["qnn/sm8650/fp16-ctx64-blocks"]
    return out


@pytest.mark.parametrize("device", ["host:executorch", "host:onnxruntime"])
def test_blocks_variant_generates_the_full_layouts_tokens(blocks_export, window7_export, device):
    blocks = QNNModelForCausalLM.from_pretrained(blocks_export, device=device)
    full = QNNModelForCausalLM.from_pretrained(window7_export("fp16", 8), device=device)
    contract = blocks.contract
    assert blocks.manifest.contract.cache_layout == "blocks" and blocks.manifest.contract.block_len == BLOCK
    assert contract.ring_len == WINDOW7
    layer = next(l for l in contract.cache_layers if contract.is_blocked(l))
    for method, last in ((DECODE_METHOD, 15), (PREFILL_METHOD, 8)):
        shapes = {t.name: t.shape for t in contract.method(method).inputs}
        assert [shapes[f"k_cache_{layer.index}_block{b}"][-1] for b in range(4)] == [16, 16, 16, last]
        assert f"k_cache_{layer.index}" not in shapes
    for n in (24, 10):
        prompt = torch.tensor(PROMPTS[n])
        got = blocks.generate(prompt, max_new_tokens=16, eos_token_id=[])[0, n:].tolist()
        want = full.generate(prompt, max_new_tokens=16, eos_token_id=[])[0, n:].tolist()
        print(f"{device} prompt {n}: blocks {got} full {want}")
        assert len(got) == 16 and got == want

