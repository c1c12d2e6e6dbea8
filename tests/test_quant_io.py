"""Integer graph IO (uint16 masks, caches and logits) in the contract and the host session, without an export.

A session over a contract with integer IO must hand each call exactly the quantized values of what a session over
the float contract hands it, copy the new K/V into the caches unchanged, and return dequantized logits.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD, AttentionKind, LayerSpec, RunnerContract
from optimum_qnn.ops.mask import MASK_MIN
from optimum_qnn.quantization.io import io_dtype, quantized_inputs
from optimum_qnn.session import KVSession, torch_method

CONTEXT, AR, WINDOW, VOCAB = 24, 4, 5, 32
LAYERS = (LayerSpec(0, AttentionKind.SLIDING, 8, 1, 0, 0), LayerSpec(1, AttentionKind.FULL, 16, 2, 1, 1))
MASK_ENC = (-MASK_MIN / 65535, 65535, "uint16")  # what calibration gives the masks: [-255, 0] over 16 bits


def contracts() -> tuple[RunnerContract, RunnerContract]:
    float_contract = RunnerContract.build(
        LAYERS, vocab_size=VOCAB, context_len=CONTEXT, ar_lens={PREFILL_METHOD: AR, DECODE_METHOD: 1},
        sliding_window=WINDOW,
    )
    encodings = {"atten_mask": MASK_ENC, "sliding_atten_mask": MASK_ENC, "logits": (0.01, 30000, "uint16")}
    for i, layer in enumerate(LAYERS):
        encodings[f"k_cache_{layer.index}"] = encodings[f"k_new_{layer.index}"] = (1e-3 * (i + 1), 32000 + i, "uint16")
        encodings[f"v_cache_{layer.index}"] = encodings[f"v_new_{layer.index}"] = (2e-3 * (i + 1), 31000 - i, "uint16")
    return float_contract, float_contract.with_quantized_io(encodings)


def test_contract_with_integer_io():
    float_contract, contract = contracts()
    assert (contract.mask_attend, contract.mask_masked) == (65535.0, 0.0)  # ExecuTorch's runner's uint16 values
    assert contract.kv_io_bits == 16 and float_contract.kv_io_bits == 32
    for method in contract.methods:
        dtypes = {t.name: t.dtype for t in (*method.inputs, *method.outputs)}
        assert dtypes["tokens"] == "int64" and dtypes["input_pos"] == "int32"
        assert {d for n, d in dtypes.items() if n not in ("tokens", "input_pos")} == {"uint16"}
        assert sorted(quantized_inputs(float_contract.method(method.name))) == [1, 2, *range(4, 4 + 2 * len(LAYERS))]
    assert RunnerContract.from_dict(contract.to_dict()) == contract


def test_io_dtype_of_a_quantization_range():
    assert io_dtype(0, 65535) is torch.uint16 and io_dtype(0, 255) is torch.uint8
    with pytest.raises(ValueError, match="--float-io"):
        io_dtype(-32768, 32767)


def _session(contract: RunnerContract, calls: list):
    def method(name):
        spec = contract.method(name)

        def run(*inputs):
            calls.append((name, [t.clone() for t in inputs]))
            pos = inputs[3][0].to(torch.int64)
            outs = []
            for o in spec.outputs:
                dtype = getattr(torch, o.dtype)
                if o.name == "logits":  # a known integer pattern per row
                    outs.append((pos.view(1, -1, 1) * 7 + torch.arange(VOCAB)).to(dtype).expand(o.shape).clone())
                elif o.name.startswith("k_new_"):
                    outs.append((pos.view(1, 1, 1, -1) + 100).to(dtype).expand(o.shape).clone())
                else:
                    outs.append((pos.view(1, 1, -1, 1) + 200).to(dtype).expand(o.shape).clone())
            return outs

        return run

    return KVSession(contract, {m.name: torch_method(method(m.name)) for m in contract.methods})


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.integers(1, 7), min_size=1, max_size=6))
def test_integer_session_hands_each_call_the_quantized_float_inputs(chunks):
    float_contract, contract = contracts()
    float_calls, int_calls = [], []
    float_session, session = _session(float_contract, float_calls), _session(contract, int_calls)
    for n in chunks:
        n = min(n, session.capacity - session.n_past)
        if n == 0:
            break
        ids = torch.arange(n) % VOCAB
        float_session.feed(ids)
        logits = session.feed(ids)
        spec = contract.method(DECODE_METHOD).outputs[0]
        assert logits.dtype == torch.float32
        expected = spec.dequantize(((torch.arange(session.n_past - n, session.n_past) * 7).view(-1, 1) + torch.arange(VOCAB)).to(torch.uint16))
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert [name for name, _ in int_calls] == [name for name, _ in float_calls]
    for (name, got), (_, ref) in zip(int_calls, float_calls):
        specs = contract.method(name).inputs
        assert [t.dtype for t in got] == [getattr(torch, s.dtype) for s in specs]
        for i in (1, 2):  # masks: exactly the quantized float masks
            assert torch.equal(got[i], specs[i].quantize(ref[i])), (name, specs[i].name)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[3], ref[3])
        n_past = int(got[3][0, 0])
        # Caches: the fake outputs' integers, copied unchanged into slots [0, n_past).
        for k in got[4 : 4 + len(LAYERS)]:
            assert torch.equal(k[..., :n_past], (torch.arange(n_past) + 100).to(torch.uint16).expand(*k.shape[:-1], n_past))
        for v in got[4 + len(LAYERS) :]:
            assert torch.equal(v[:, :, :n_past, :], (torch.arange(n_past) + 200).to(torch.uint16).view(1, 1, -1, 1).expand(*v.shape[:2], n_past, v.shape[-1]))


@pytest.mark.slow
def test_uint16_io_matches_float_io_on_the_emulator(demo_model_dir, tmp_path, qnn_sdk):
    """The same 16a8w demo export with uint16 and with float32 IO: same greedy tokens, logits SQNR >= 40 dB."""
    import tiny_gemma4  # on sys.path through the demo_model_dir fixture

    from optimum_qnn.quantization.calibration import CalibrationSource
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.evaluation import sqnr_db
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:40]))
    models = {}
    for float_io in (False, True):
        config = ExportConfig(
            socs=(Soc.SM8650,), quant=QuantScheme.A16W8, mode=ExportMode.HYBRID, shapes=ShapeConfig(64, 16),
            embedding_quant=EmbeddingQuant(8, 0), weight_sharing=False, float_io=float_io,
        )
        out = tmp_path / f"float_io-{float_io}"
        export(demo_model_dir, out, config, calibration=CalibrationSource(file=calib, limit=8))
        models[float_io] = QNNModelForCausalLM.from_pretrained(out)
    assert models[False].contract.kv_io_bits == 16 and models[True].contract.kv_io_bits == 32
    ids = torch.tensor([2] + list(range(40, 60)))
    tokens = {k: m.generate(ids, max_new_tokens=32, eos_token_id=[])[0, ids.numel():].tolist() for k, m in models.items()}
    assert tokens[False] == tokens[True]
    logits = {}
    for k, m in models.items():
        m.backend.session.reset()
        logits[k] = m.backend.session.feed(torch.tensor([2] + list(range(40, 100))))
    sqnr = sqnr_db(logits[False], logits[True])
    print(f"uint16 IO vs float IO: 32/32 greedy tokens equal, logits SQNR {sqnr:.1f} dB")
    assert sqnr >= 40
