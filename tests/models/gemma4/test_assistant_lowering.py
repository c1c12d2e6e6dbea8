"""The drafter lowered to QNN (fp16, SM8650) as its own method beside the target's decode method in one .pte, run
on the x86 HTP emulator through executorch.runtime against the eager twins (docs/assistant.md)."""

from __future__ import annotations

import pytest
import torch

from optimum_qnn import StaticCausalLM
from optimum_qnn.config import Soc
from optimum_qnn.contract import DECODE_METHOD, DRAFT_METHOD
from optimum_qnn.metrics import sqnr_db
from optimum_qnn.models.gemma4.assistant import StaticDrafter
from tests.gemma4_assistant_tiny import tiny_assistant, tiny_assistant_config
from tests.gemma4_tiny import tiny_config, tiny_model
from tests.htp_graphs import run_method

CTX = 32
# fp16 on the x86 HTP emulator, these random tiny weights: the target's own kv_forward logits measure 26-37 dB against
# its eager twin over 22 decode steps; the drafter's measure 48.6 dB (position 5) and 41.7 dB (position 20).
MIN_SQNR_DB = 30.0


def _lower(ordered: bool, with_target: bool):
    """The tiny target's drafter lowered (fp16, SM8650), beside the target's kv_forward or alone; the embedding
    lookups stay on the CPU, as in the pipeline; weights not shared (the x86 emulator loads no shared-weight program)."""
    from optimum_qnn.exporter.lowering import lower_to_pte

    config = tiny_config()
    target = StaticCausalLM.from_hf(tiny_model(config, seed=1), max_context_len=CTX, hidden_output=True)
    drafter = StaticDrafter.from_hf(tiny_assistant(tiny_assistant_config(config, ordered=ordered), seed=2), target)
    programs = {DECODE_METHOD: target.export(DECODE_METHOD)} if with_target else {}
    programs[DRAFT_METHOD] = torch.export.export(drafter.module, drafter.example_inputs(), strict=False)
    return drafter, lower_to_pte(programs, Soc.SM8650, fp16=True, weight_sharing=False,
                                 skip_ops={"aten.embedding.default"}, int64_inputs={"tokens"})


@pytest.fixture(scope="module")
def lowered(qnn_sdk, tmp_path_factory):
    """One .pte: kv_forward of a tiny target and draft_forward of its drafter."""
    drafter, program = _lower(ordered=False, with_target=True)
    return drafter, program, program.write(tmp_path_factory.mktemp("draft") / "draft.pte")


@pytest.fixture(scope="module")
def lowered_ordered(qnn_sdk, tmp_path_factory):
    """A drafter with ordered (clustered) output embeddings, alone in its .pte: topk, gathers and a scatter."""
    drafter, program = _lower(ordered=True, with_target=False)
    return drafter, program, program.write(tmp_path_factory.mktemp("ordered") / "ordered.pte")


def _draft_inputs(drafter: StaticDrafter, p: int) -> tuple[torch.Tensor, ...]:
    """A step at position ``p`` as the target hands it over: its caches after eager decode steps over ``p`` tokens and
    its last hidden state (the target is built with ``hidden_output``)."""
    session = drafter.target.session()
    decode = session.methods[DECODE_METHOD]
    last: list = []

    def recording(inputs):
        last[:] = [decode(inputs)]
        return last[0]

    session.methods = {DECODE_METHOD: recording}
    ids = torch.randint(3, drafter.target.text_config.vocab_size, (p + 1,), generator=torch.Generator().manual_seed(p))
    session.feed(ids[:p])
    caches = {f"k_cache_{l.index}": torch.from_numpy(k) for l, k in zip(session.cache_layers, session.k_bufs)}
    caches |= {f"v_cache_{l.index}": torch.from_numpy(v) for l, v in zip(session.cache_layers, session.v_bufs)}
    full, sliding = drafter.masks(p)
    given = {"tokens": ids[p:].view(1, 1), "hidden": last[0][-1], "atten_mask": full, "sliding_atten_mask": sliding,
             "input_pos": torch.tensor([[p]], dtype=torch.int32)}
    return tuple((given | caches)[t.name] for t in drafter.method.inputs)


def test_the_drafter_is_its_own_fully_delegated_method_beside_the_target(lowered):
    _, program, _ = lowered
    assert set(program.delegation) >= {DECODE_METHOD, DRAFT_METHOD}
    draft = program.delegation[DRAFT_METHOD]
    assert draft.partitions == 1 and set(draft.on_cpu) <= {"aten.embedding.default"}, draft


@pytest.mark.parametrize("p", [5, 20], ids=["inside-window", "past-window"])
@pytest.mark.parametrize("which", ["lowered", "lowered_ordered"], ids=["lm_head", "ordered-embeddings"])
def test_the_drafter_on_the_emulator_matches_its_eager_twin(which, p, request):
    """Measured (SQNR of logits, hidden_out): lm_head 48.6 / 47.0 dB at position 5, 41.7 / 40.8 dB at 20; ordered
    embeddings 56.0 / 40.1 and 66.2 / 43.2 dB (QNN splits that one in two partitions around a view of the int64
    token ordering, which stays on the CPU)."""
    drafter, _, path = request.getfixturevalue(which)
    inputs = _draft_inputs(drafter, p)
    logits, hidden_out = run_method(path, DRAFT_METHOD, inputs)
    with torch.no_grad():
        ref_logits, ref_hidden = drafter.module(*inputs)
    assert sqnr_db(logits, ref_logits) >= MIN_SQNR_DB
    assert sqnr_db(hidden_out, ref_hidden) >= MIN_SQNR_DB
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


@pytest.fixture(scope="module")
def lowered_16a8w(qnn_sdk, tmp_path_factory):
    """The drafter PT2E-quantized at 16a8w (QnnQuantizer, calibrated on steps at positions 3, 6, .. 27 over the
    target's own caches and hidden states), lowered alone; returns the drafter, its converted graph and the .pte."""
    from optimum_qnn.exporter.lowering import lower_to_pte
    from optimum_qnn.quantization.pt2e import make_quantizer, quantize

    config = tiny_config()
    target = StaticCausalLM.from_hf(tiny_model(config, seed=1), max_context_len=CTX, hidden_output=True)
    drafter = StaticDrafter.from_hf(tiny_assistant(tiny_assistant_config(config), seed=2), target)
    example = drafter.example_inputs()
    batches = [_draft_inputs(drafter, p) for p in range(3, CTX - 2, 3)]  # not the tested positions

    def calibrate(prepared):
        for inputs in batches:
            prepared(*inputs)

    converted = quantize(torch.export.export(drafter.module, example, strict=False), calibrate, make_quantizer("16a8w"))
    program = lower_to_pte({DRAFT_METHOD: (converted, example)}, Soc.SM8650, fp16=False, weight_sharing=False,
                           skip_ops={"aten.embedding.default"}, int64_inputs={"tokens"})
    assert program.delegation[DRAFT_METHOD].partitions == 1
    return drafter, converted, program.write(tmp_path_factory.mktemp("q") / "draft_16a8w.pte")


@pytest.mark.parametrize("p", [5, 20], ids=["inside-window", "past-window"])
def test_the_16a8w_drafter_on_the_emulator_computes_its_quantized_graph(lowered_16a8w, p):
    """The HTP runs the converted graph's integer math: measured 51.5 / 56.5 dB (logits) and 50.4 / 55.7 dB
    (hidden_out) against the converted graph, the same argmax."""
    drafter, converted, path = lowered_16a8w
    inputs = _draft_inputs(drafter, p)
    logits, hidden_out = run_method(path, DRAFT_METHOD, inputs)
    with torch.no_grad():
        ref_logits, ref_hidden = converted(*inputs)
    assert sqnr_db(logits, ref_logits) >= 40.0
    assert sqnr_db(hidden_out, ref_hidden) >= 40.0
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
