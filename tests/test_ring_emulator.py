"""The ring cache layout exported and run on the x86 HTP emulator: the same greedy tokens as the full-length layout.

The demo model with a window of 7 (tests/conftest.py `window7_model_dir`), fp16, context 64, prefill chunks of 8
(longer than the window: the graph's band closes the call's own out-of-window columns over the ring's columns). The
24-token prompt is more than 3x the window and three prefill chunks; 16 generated tokens wrap the ring twice more.
"""

from __future__ import annotations

import torch

from optimum_qnn.contract import DECODE_METHOD, AttentionKind, CacheLayout
from optimum_qnn.metrics import sqnr_db
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
from tests.conftest import WINDOW7, WINDOW7_CTX
from tests.test_window_chunks import PROMPTS


def test_ring_variant_generates_the_full_layouts_tokens(window7_model_dir, window7_export, tmp_path_factory):
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    out = tmp_path_factory.mktemp("window7-ring")
    config = ExportConfig(
        socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.HYBRID,
        shapes=ShapeConfig(WINDOW7_CTX, 8, cache_layout=CacheLayout.RING),
        embedding_quant=EmbeddingQuant(0, 0), weight_sharing=False,
    )
    result = export(window7_model_dir, out, config)
    assert [v.relative_to(out).as_posix() for v in result.variants] == ["qnn/sm8650/fp16-ctx64-ring"]
    ring = QNNModelForCausalLM.from_pretrained(out)
    full = QNNModelForCausalLM.from_pretrained(window7_export("fp16", 8))
    assert ring.manifest.contract.cache_layout == "ring"
    contract = ring.contract
    sliding = [l for l in contract.cache_layers if l.attention is AttentionKind.SLIDING]
    assert sliding and all(contract.cache_slots(l) == WINDOW7 for l in sliding)
    decode = {t.name: t.shape for t in contract.method(DECODE_METHOD).inputs}
    assert decode[f"k_cache_{sliding[0].index}"][-1] == WINDOW7
    for n in (24, 10):
        prompt = torch.tensor(PROMPTS[n])
        got = ring.generate(prompt, max_new_tokens=16, eos_token_id=[])[0, n:].tolist()
        want = full.generate(prompt, max_new_tokens=16, eos_token_id=[])[0, n:].tolist()
        print(f"prompt {n}: ring {got} full {want}")
        assert len(got) == 16 and got == want
    # Every prompt token's logits, as the other emulator conformance tests bound them (60 dB).
    ring.backend.session.reset()
    full.backend.session.reset()
    prompt = torch.tensor(PROMPTS[24])
    sqnr = sqnr_db(ring.backend.session.feed(prompt), full.backend.session.feed(prompt))
    print(f"prompt logits, ring against full: {sqnr:.1f} dB")
    assert sqnr >= 60
