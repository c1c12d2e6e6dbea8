"""Conformance with ExecuTorch's `qnn_llama_runner`: exported .pte files driven the way the stock runner drives them.

`tests/stock_runner.py` rewrites the runner's host side (its mask values, int32 positions, SMART_MASK caches that
are re-laid out when it switches between the prefill and decode graphs) from its C++ sources; these tests feed
exported programs through it on the emulator and compare with `QNNModelForCausalLM`. The real runner runs in
tests/test_device_adb.py when one is built.
"""

from __future__ import annotations

import pytest
import torch

from optimum_qnn.exporter.evaluation import sqnr_db
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
from tests.stock_runner import StockRunnerHost

# fp16 hybrid (float IO), fp16 kv, 16a8w hybrid in two shards with uint16 IO.
EXPORTS = ["fp16_export", "demo_kv_export", "cli_16a8w_export"]


def _artifact(request, name):
    value = request.getfixturevalue(name)
    return value[0] if isinstance(value, tuple) else getattr(value, "output", value)


@pytest.mark.parametrize("export", EXPORTS)
def test_graph_io_is_not_memory_planned(request, export):
    """The runner hands every method its own input and output buffers (`set_outputs`): planned IO refuses them."""
    model = QNNModelForCausalLM.from_pretrained(_artifact(request, export))
    program = model.backend.program.program
    for spec in model.contract.methods:
        meta = program.metadata(spec.name)
        planned = [f"input {i}" for i in range(meta.num_inputs()) if meta.input_tensor_meta(i).is_memory_planned()]
        planned += [f"output {i}" for i in range(meta.num_outputs()) if meta.output_tensor_meta(i).is_memory_planned()]
        assert not planned, f"{spec.name}: memory-planned {planned}"


@pytest.mark.parametrize("export", EXPORTS)
def test_stock_runner_inputs_give_the_project_s_tokens_and_logits(request, export):
    model = QNNModelForCausalLM.from_pretrained(_artifact(request, export))
    host = StockRunnerHost(model.backend.program.program, model.backend.program.methods)
    ar = max(host.ar_lens.values())
    # Two prefill calls, the second one partial (its padding rows hold the first call's tokens), then decode steps
    # whose caches were re-laid out from the prefill graph's length to the decode graph's.
    prompt = [2] + list(range(40, 40 + ar + ar // 2))
    new, runner_logits = host.generate(prompt, max_new_tokens=12)
    ours = model.generate(torch.tensor(prompt), max_new_tokens=12, eos_token_id=[])[0, len(prompt):].tolist()
    assert new == ours
    model.backend.session.reset()
    our_logits = model.backend.session.feed(torch.tensor(prompt))[-1]
    logits_spec = model.contract.methods[0].outputs[0]
    if logits_spec.quantized:  # the runner argmaxes the raw uint16 logits; the host dequantizes them
        assert runner_logits.dtype == torch.uint16 and host.mask_dtype == torch.uint16
        runner_logits = logits_spec.dequantize(runner_logits)
    sqnr = sqnr_db(runner_logits.float(), our_logits)
    print(f"{export}: runner calls {host.calls[:3]}..., first-token logits SQNR {sqnr:.1f} dB, tokens {new}")
    assert sqnr >= 60
