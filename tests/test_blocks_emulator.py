"""The blocks cache layout exported and run on the x86 HTP emulator against the full layout, through both in-process
backends (ExecuTorch's Python runtime and onnxruntime-qnn): fp16 gives the same greedy tokens, 16a8w the same
teacher-forced argmax at >= 95 % of positions and logits within 1 dB of the full layout's SQNR against the float model.

The window-7 demo model (tests/conftest.py `window7_model_dir`), context 64, prefill chunks of 8, blocks forced
to 16 slots (`ShapeConfig.cache_block_len`): each full-attention cache is four inputs (16, 16, 16, 15 slots in the
decode graph; 16, 16, 16, 8 in the prefill graph), the sliding layers keep their ring of 7. The 24-token prompt spans
a block boundary and three prefill chunks; 16 generated tokens cross the next boundary.

16a8w keeps integer IO (uint16 caches), calibrated as the full layout's export it is compared with (the shared
`window7_export` fixture, which tests/test_window_chunks.py also runs): every block of a cache shares its first
block's observer (`tie_cache_observers`), so the blocks hold the values the full layout's one cache input holds. The
two graphs still round differently (`blocked_gqa` quantizes each block's scores and each block's share of the output
on their own, where the full layout has one matmul of each), so 16a8w is compared teacher-forced, not by greedy
tokens, and against the float model both were exported from: the blocks must lose no more than the full layout loses.
Measured on the demo model trained with portable kernels (examples/tiny_gemma4.py), through host:onnxruntime, logits
SQNR against the float model: full layout 43.3 / 44.1 dB (24- / 10-token prompt), blocks 43.0 / 44.1 dB, argmax
agreement 1.000 each; blocks against full 55.5 / 69.2 dB (the 24-token prompt reads two blocks more). Bounds: argmax
agreement with the full layout >= 0.95, and the blocks' SQNR against the float model at most 1 dB under the full
layout's (a 60 dB bound on blocks against full, held on the weights an AVX-512 machine trained, measured the two
roundings' difference rather than a loss).
"""

from __future__ import annotations

import pytest
import torch

from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD
from optimum_qnn.metrics import sqnr_db
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
from tests.conftest import WINDOW7
from tests.test_window_chunks import PROMPTS

BLOCK, AR = 16, 8


@pytest.mark.parametrize("quant", ["fp16", "16a8w"])
# Through ExecuTorch's runtime in `make test-all` only (676 s of the suite's time): both runtimes drive the same
# KVSession, and onnxruntime's outputs are byte-identical to ExecuTorch's on the same .pte, the blocks layout's too
# (`test_both_runtimes_compute_the_same_bytes` below, on these very exports), as test_lookahead reasons.
@pytest.mark.parametrize("device", [pytest.param("host:executorch", marks=pytest.mark.slow), "host:onnxruntime"])
def test_blocks_variant_matches_the_full_layout(window7_export, window7_model_dir, quant, device):
    out = window7_export(quant, AR, BLOCK)
    assert [p.parent.relative_to(out).as_posix() for p in out.glob("qnn/*/*/manifest.json")] == [
        f"qnn/sm8650/{quant}-ctx64-blocks"]
    blocks = QNNModelForCausalLM.from_pretrained(out, device=device)
    full = QNNModelForCausalLM.from_pretrained(window7_export(quant, AR), device=device)
    contract = blocks.contract
    assert blocks.manifest.contract.cache_layout == "blocks" and blocks.manifest.contract.block_len == BLOCK
    assert contract.ring_len == WINDOW7
    layer = next(l for l in contract.cache_layers if contract.is_blocked(l))
    for method, last in ((DECODE_METHOD, 15), (PREFILL_METHOD, 8)):
        inputs = {t.name: t for t in contract.method(method).inputs}
        assert [inputs[f"k_cache_{layer.index}_block{b}"].shape[-1] for b in range(4)] == [16, 16, 16, last]
        assert f"k_cache_{layer.index}" not in inputs
        if quant == "16a8w":  # integer IO: the blocks are uint16, as the full layout's cache is
            assert {str(inputs[f"v_cache_{layer.index}_block{b}"].dtype) for b in range(4)} == {"uint16"}
    if quant == "16a8w":
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(window7_model_dir, dtype=torch.float32).eval()
    for n in (24, 10):
        prompt = torch.tensor(PROMPTS[n])
        want = full.generate(prompt, max_new_tokens=16, eos_token_id=[])[0]
        if quant == "fp16":
            got = blocks.generate(prompt, max_new_tokens=16, eos_token_id=[])[0, n:].tolist()
            print(f"{quant} {device} prompt {n}: blocks {got} full {want[n:].tolist()}")
            assert len(got) == 16 and got == want[n:].tolist()
            continue
        # Teacher-forced: both read the full layout's tokens (prefill of the prompt, then decode one at a time).
        got_logits, want_logits = _step_logits(blocks, want, n), _step_logits(full, want, n)
        with torch.no_grad():
            float_logits = reference(want[None]).logits[0]
        agree = (got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean().item()
        got_db, want_db = sqnr_db(got_logits, float_logits), sqnr_db(want_logits, float_logits)
        print(f"{quant} {device} prompt {n}: argmax agreement {agree:.3f} over {len(want)} positions; SQNR against "
              f"the float model: blocks {got_db:.1f} dB, full {want_db:.1f} dB; blocks against full "
              f"{sqnr_db(got_logits, want_logits):.1f} dB")
        assert agree >= 0.95 and got_db >= want_db - 1.0


@pytest.mark.parametrize("quant", ["fp16", "16a8w"])
def test_both_runtimes_compute_the_same_bytes(window7_export, quant):
    """The blocks variant's methods through onnxruntime-qnn and through ExecuTorch's runtime, on the same inputs (two
    calls each, different inputs): the outputs' bytes equal, so the greedy and teacher-forced checks above, run
    through onnxruntime in `make test`, hold for ExecuTorch's runtime too."""
    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.runtime.backends.onnxruntime import OrtProgram
    from tests.runtime.backends.ort_helpers import contract_inputs, executorch_outputs, same_bytes, variant_dirs

    (folder,) = variant_dirs(window7_export(quant, AR, BLOCK))
    manifest = read_manifest(folder)
    program = OrtProgram(folder / "model.pte", manifest)
    for method in manifest.contract.methods:
        for seed in range(2):
            inputs = contract_inputs(manifest, method.name, seed)
            ours, theirs = program.methods[method.name](inputs), executorch_outputs(folder, method.name, inputs)
            assert len(ours) == len(theirs) == len(method.outputs)
            for spec, a, b in zip(method.outputs, ours, theirs):
                assert same_bytes(a, b), f"{method.name} call {seed}: {spec.name} differs from ExecuTorch's"


def _step_logits(model: QNNModelForCausalLM, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The logits of every position of ``ids``: the prompt in one feed (prefill chunks), the rest one by one."""
    session = model.backend.session
    session.reset()
    return torch.cat([session.feed(ids[:prompt_len])] + [session.feed(ids[t : t + 1]) for t in range(prompt_len, len(ids))])


# 16a8w in `make test-all` only (~290 s, its own two-shard export): the cut is checked at fp16 here, and a 16a8w program in
# two shards against ExecuTorch's runtime in tests/runtime/backends/test_ort_program.py (`test_16a8w_two_shards_identical`).
@pytest.mark.parametrize("quant", ["fp16", pytest.param("16a8w", marks=pytest.mark.slow)])
def test_blocks_in_two_shards_are_the_blocks_in_one(window7_export, quant):
    """Cut in two QNN contexts per method, the blocks layout computes what it computes in one: the demo's layer 5
    reuses the K/V of layer 2 across the cut, and joins that cache's blocks (program inputs, uint16 at 16a8w) and
    its new columns in its own shard; no block crosses between the shards as float32. Through host:onnxruntime: fp16
    the same greedy tokens; 16a8w the same teacher-forced argmax at every position and logits SQNR >= 60 dB (the
    two exports' graphs hold the same ops and encodings, split at another place)."""
    from optimum_qnn.artifacts.inspection import inspect_pte

    one = QNNModelForCausalLM.from_pretrained(window7_export(quant, AR, BLOCK), device="host:onnxruntime")
    out = window7_export(quant, AR, BLOCK, 2)
    two = QNNModelForCausalLM.from_pretrained(out, device="host:onnxruntime")
    assert two.manifest.contract.shards == 2
    if quant == "16a8w":
        blocks = {tuple(t.shape) for m in two.manifest.contract.methods for t in m.inputs if "_block" in t.name}
        (pte,) = out.glob("qnn/*/*/model.pte")
        later = inspect_pte(pte).contexts[1]
        for graph in later.graphs:
            crossing = [(t.name, t.shape) for t in graph.inputs if t.dtype == "float32" and tuple(t.shape) in blocks]
            assert not crossing, f"{graph.name}: blocks cross the shards as float32: {crossing}"
            assert any(t.dtype == "ufixed16" and tuple(t.shape) in blocks for t in graph.inputs), graph.name
    prompt = torch.tensor(PROMPTS[24])
    want = one.generate(prompt, max_new_tokens=16, eos_token_id=[])[0]
    if quant == "fp16":
        assert two.generate(prompt, max_new_tokens=16, eos_token_id=[])[0].tolist() == want.tolist()
        return
    got_logits, want_logits = _step_logits(two, want, 24), _step_logits(one, want, 24)
    agree = (got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean().item()
    sqnr = sqnr_db(got_logits, want_logits)
    print(f"16a8w blocks, 2 shards against 1: argmax agreement {agree:.3f}, SQNR {sqnr:.1f} dB")
    assert agree == 1.0 and sqnr >= 60
