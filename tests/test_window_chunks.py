"""A prefill chunk longer than the sliding window (issue 33).

ExecuTorch's `qnn_llama_runner` opens a call's own mask columns causally and applies the sliding window to past
columns only (`KVManager::init_attention_mask` / `update_attention_mask`), so a prefill call of more tokens than the
window would let a token see its own chunk's tokens beyond the window. The exported prefill graph closes those
columns itself (`ops.mask.window_band`); these tests feed the runner's masks (tests/stock_runner.py) and the host's
to exports with a window of 7 and chunks of 4 and 8, and compare the tokens. The real runner runs the same exports in
tests/test_device_adb.py when `QNN_LLAMA_RUNNER` is set.
"""

from __future__ import annotations

import pytest
import torch

from optimum_qnn.exporter.evaluation import sqnr_db
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
from optimum_qnn.models.gemma4.modeling import StaticCausalLM
from tests.conftest import WINDOW7, WINDOW7_CTX
from tests.stock_runner import StockRunnerHost

# 24 tokens: three chunks of 8 (six of 4), longer than the window; 10: a partial second chunk; 4: one call.
PROMPTS = {24: [2] + list(range(40, 63)), 10: [2] + list(range(70, 79)), 4: [2, 40, 41, 42]}
CASES = [
    ("fp16", 4), ("fp16", 8),
    pytest.param("16a8w", 4, marks=pytest.mark.slow), ("16a8w", 8),
    # 8-bit activations: the band's op must have an 8-bit HTP kernel (a `minimum` had none: the compile failed).
    ("8a8w", 8),
]


def test_stock_runner_masks_apply_the_window_to_past_columns_only(window7_export):
    """What the rewrite reproduces from the C++ runner: in a call of 8 over a window of 7, row 7 still sees its
    chunk's first token, while a past slot 7 positions back is closed."""
    model = QNNModelForCausalLM.from_pretrained(window7_export("fp16", 8))
    host = StockRunnerHost(model.backend.program.program, model.backend.program.methods)
    assert host.window == WINDOW7 and host.ar_lens["prefill_forward"] == 8
    pos, neg = host._values()
    first = host._init_mask(8, 0, WINDOW7)
    assert first[7, WINDOW7_CTX - 8] == pos  # own column 0 from row 7: beyond the window, yet open
    later = host._init_mask(8, 8, WINDOW7)
    assert later[0, 1] == neg and later[0, 2] == pos  # row 0 is position 8: slot 1 is 7 back, slot 2 is 6 back


def test_prefill_graph_closes_its_own_columns_outside_the_window(window7_model_dir):
    """Eager, fp32: the static module given the runner's mask (own columns causal, no window) computes what it
    computes from the host's mask; without the in-graph band the two differ (so the check can fail)."""

    static = _static(window7_model_dir, ar_len=8)
    assert static.module.model.window_bands == {8}
    ours, runner = _masked_logits(static)
    assert torch.equal(ours, runner)
    static.module.model.window_bands = set()
    ours, runner = _masked_logits(static)
    assert (ours - runner).abs().max() > 1e-3


@pytest.mark.parametrize(("quant", "ar_len"), CASES)
def test_runner_masks_give_the_host_tokens(window7_export, quant, ar_len):
    """Every prompt, chunk 4 and 8 over a window of 7: the stock runner's inputs give the host's greedy tokens
    and the same first-token logits (60 dB, as the other conformance tests)."""
    model = QNNModelForCausalLM.from_pretrained(window7_export(quant, ar_len))
    assert model.manifest.contract.sliding_window == WINDOW7
    logits_spec = model.contract.methods[0].outputs[0]
    for n, prompt in PROMPTS.items():
        host = StockRunnerHost(model.backend.program.program, model.backend.program.methods)
        new, runner_logits = host.generate(prompt, max_new_tokens=12)
        ours = model.generate(torch.tensor(prompt), max_new_tokens=12, eos_token_id=[])[0, len(prompt):].tolist()
        model.backend.session.reset()
        our_logits = model.backend.session.feed(torch.tensor(prompt))[-1]
        if logits_spec.quantized:
            runner_logits = logits_spec.dequantize(runner_logits)
        sqnr = sqnr_db(runner_logits.float(), our_logits)
        print(f"{quant} chunk {ar_len}, prompt {n}: calls {len(host.calls)}, SQNR {sqnr:.1f} dB, equal {new == ours}")
        assert new == ours, (n, new, ours)
        assert sqnr >= 60, (n, sqnr)


def _static(model_dir, ar_len: int) -> StaticCausalLM:
    from optimum_qnn.models.gemma4.loading import load_text_model

    return StaticCausalLM.from_hf(load_text_model(model_dir)[0], max_context_len=WINDOW7_CTX, ar_len=ar_len)


@torch.no_grad()
def _masked_logits(static: StaticCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a second prefill call (8 past tokens) under the host's masks and under the runner's."""
    from optimum_qnn.ops.mask import attention_mask

    ctx, ar = WINDOW7_CTX, 8
    inputs = list(static.contract.example_inputs("prefill_forward"))
    torch.manual_seed(0)
    inputs[0] = torch.randint(3, 500, (1, ar))
    inputs[3] = torch.arange(ar, 2 * ar, dtype=inputs[3].dtype).view(1, ar)
    for i in range(4, len(inputs)):
        inputs[i] = torch.randn_like(inputs[i])
    full = torch.from_numpy(attention_mask(ar, ctx, ar))
    window = torch.from_numpy(attention_mask(ar, ctx, ar, window=WINDOW7))
    ours = static.module(inputs[0], full, window, *inputs[3:])[0]
    runner = full.clone()  # own columns causal (as the full mask), past columns closed by the window
    runner[..., : ctx - ar] = window[..., : ctx - ar]
    return ours, static.module(inputs[0], full, runner, *inputs[3:])[0]
