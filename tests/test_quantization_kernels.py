"""optimum_qnn.quantization: the CPU-side quantized embedding tables, the LPBQ emulator crash the block-size fallback
avoids, the quantizer's argument checks and LPBQ block sizes, and the row-chunked quantization kernels (equal to the reference, with bounded temporaries)."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optimum_qnn.config import EmbeddingQuant, QuantScheme
from optimum_qnn.quantization.embedding import QuantizedEmbedding
from optimum_qnn.quantization.kernels import row_gather_lookups
from tests.test_quantization import sqnr


# --- CPU-side embeddings ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bits", "group", "symmetric", "floor_db"),
    # measured on a N(0, 1) bf16 table, asymmetric: 4-bit/32: 21.8 dB, 4-bit/128: 19.9, 8-bit/64: 45.4, 8-bit per
    # row: 43.8; symmetric (fp16 scales): 4-bit/32: 20.8, 4-bit/128: 19.0, 8-bit/64: 44.6, 8-bit per row: 43.2
    [(4, 32, False, 21.0), (4, 128, False, 19.0), (8, 64, False, 44.5), (8, 256, False, 43.0),
     (4, 32, True, 20.0), (4, 128, True, 18.2), (8, 64, True, 43.8), (8, 256, True, 42.4)],
)
def test_quantized_embedding_error(bits, group, symmetric, floor_db):
    torch.manual_seed(0)
    table = torch.randn(512, 256, dtype=torch.bfloat16)
    emb = QuantizedEmbedding(table, EmbeddingQuant(bits, group, symmetric))
    assert (emb.zero_points is None) == symmetric
    assert emb.scales.dtype == (torch.float16 if symmetric else torch.float32)
    ids = torch.randint(0, 512, (1, 7), dtype=torch.int32)
    rows = emb(ids)
    assert rows.dtype == torch.float32 and rows.shape == (1, 7, 256)
    assert torch.equal(rows, emb.dequantized_weight()[ids.long()])
    measured = sqnr(table.float(), emb.dequantized_weight())
    print(f"{bits}-bit group {group} {'symmetric' if symmetric else 'asymmetric'}: table SQNR {measured:.1f} dB")
    assert measured >= floor_db


def test_quantized_embedding_float_variant():
    table = torch.randn(64, 32, dtype=torch.bfloat16)
    emb = QuantizedEmbedding(table, EmbeddingQuant(bits=0, group_size=0))
    ids = torch.tensor([[3, 5, 63]], dtype=torch.int32)
    assert torch.equal(emb(ids), F.embedding(ids, table.float()))


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantized_embedding_quantizes_row_chunks(monkeypatch, symmetric):
    import optimum_qnn.quantization.embedding as embedding

    torch.manual_seed(0)
    table = torch.randn(1000, 64, dtype=torch.bfloat16)
    quant = EmbeddingQuant(4, 32, symmetric)
    whole = QuantizedEmbedding(table, quant)
    seen = []
    name = "_symmetric_rows" if symmetric else "_quantize_rows"
    original = getattr(QuantizedEmbedding, name)

    def spy(self, chunk, *args):
        seen.append((chunk.dtype, chunk.numel()))
        return original(self, chunk, *args)

    monkeypatch.setattr(embedding, "_ROW_CHUNK_ELEMENTS", 64 * 100)
    monkeypatch.setattr(QuantizedEmbedding, name, spy)
    chunked = QuantizedEmbedding(table, quant)
    assert len(seen) == 10 and all(dtype == torch.bfloat16 and n <= 6400 for dtype, n in seen)
    for buffer in ("weight", "scales") + (() if symmetric else ("zero_points",)):
        assert torch.equal(getattr(whole, buffer), getattr(chunked, buffer))


def test_symmetric_tables_refuse_what_fp16_scales_cannot_hold():
    with pytest.raises(ValueError, match="asym"):
        QuantizedEmbedding(torch.full((4, 32), 1e6), EmbeddingQuant(4, 32))
    assert QuantizedEmbedding(torch.full((4, 32), 1e6), EmbeddingQuant(4, 32, symmetric=False)).zero_points is not None


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_lookups_equal_executorch_kernel(bits):
    """The lookups calibration runs (`row_gather_lookups`) give, to the bit, what ExecuTorch's C++ kernel gives in
    the .pte (fp16 scales, float32 products); its Python reference op would round the products to fp16."""
    import executorch.kernels.quantized  # noqa: F401  (the C++ quantized kernels, for the runtime)
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    
    torch.manual_seed(0)
    table = QuantizedEmbedding(torch.randn(300, 64, dtype=torch.bfloat16) * 0.05, EmbeddingQuant(bits, 32))
    ids = torch.tensor([[3, 299, 3, 0, 17]])
    pte = to_edge(torch.export.export(table, (ids,), strict=True)).to_executorch().buffer
    on_runtime = Runtime.get().load_program(pte).load_method("forward").execute([ids])[0]
    with row_gather_lookups():
        eager = table(ids)
    assert torch.equal(eager, on_runtime)
    assert not torch.equal(table(ids), on_runtime)  # the reference op's fp16 products differ


def test_quantized_embedding_rejects_bad_shapes():
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        QuantizedEmbedding(torch.randn(8, 48), EmbeddingQuant(4, 32))
    with pytest.raises(ValueError, match="2-D floating"):
        QuantizedEmbedding(torch.randint(0, 5, (8, 32)), EmbeddingQuant(4, 32))


def test_quantized_embedding_exports_cpu_ops():
    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = QuantizedEmbedding(torch.randn(64, 32), EmbeddingQuant(4, 32))
            self.b = QuantizedEmbedding(torch.randn(64, 16), EmbeddingQuant(8, 16))

        def forward(self, ids):
            return self.a(ids), self.b(ids)

    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    graph = torch.export.export(Lookup(), (ids,), strict=True).graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert targets == {"quantized_decomposed.embedding_4bit.dtype", "quantized_decomposed.embedding_byte.dtype"}


# --- the LPBQ emulator crash (documents the QAIRT 2.49.40 bug the block-size fallback avoids) -------------------

_LPBQ_CASE = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from optimum_qnn.sdk import ensure_qnn_sdk
    ensure_qnn_sdk()
    import optimum_qnn.quantization.pt2e as q
    if sys.argv[1] == "no-fallback":
        q._LPBQ_CRASH_BLOCK_COUNTS = range(0)
    from executorch.backends.qualcomm.utils.utils import to_edge_transform_and_lower_to_qnn
    from executorch.runtime import Runtime
    from optimum_qnn.config import Soc
    from optimum_qnn.exporter.lowering import compile_specs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 64, bias=False)).eval()
    x = torch.randn(1, 1, 512)
    graph = q.quantize(torch.export.export(model, (x,), strict=True), lambda m: m(x), q.make_quantizer("16a4w_block"))
    specs = compile_specs(Soc.SM8650, fp16=False)
    edge = to_edge_transform_and_lower_to_qnn(graph, (x,), specs, convert_linear_to_conv2d=True)
    pte = bytes(edge.to_executorch().buffer)
    print("LOWERED", flush=True)
    Runtime.get().load_program(pte).load_method("forward").execute([x])
    print("RAN", flush=True)
    """
)


@pytest.mark.slow
def test_lpbq_emulator_crash_and_fallback(run_python):
    crash = run_python("-c", _LPBQ_CASE, "no-fallback")
    assert "LOWERED" in crash.stdout
    assert crash.returncode == -11, (
        f"8 blocks of 64 no longer crash the emulator (return code {crash.returncode}): "
        "drop _LPBQ_CRASH_BLOCK_COUNTS from optimum_qnn/quantization/pt2e.py"
    )
    fallback = run_python("-c", _LPBQ_CASE, "fallback")
    assert fallback.returncode == 0 and "RAN" in fallback.stdout, fallback.stderr[-2000:]


def peak_extra_mb(fn):
    """``fn()`` and the most RSS above the starting point while it ran, in MB."""
    from optimum_qnn.exporter.pipeline import _RssSampler

    sampler = _RssSampler()
    base = sampler.peak
    sampler.start()
    out = fn()
    return out, sampler.stop() - base


@pytest.mark.parametrize("bits", [4, 8])
def test_row_gather_lookups_equal_reference_without_the_table_copy(bits):
    """Calibration runs the quantized lookups eagerly. ExecuTorch's reference kernels dequantize the whole table per
    call; within `row_gather_lookups` only the looked-up rows are, with identical results."""
    from optimum_qnn.config import EmbeddingQuant, QuantScheme
    from optimum_qnn.quantization.embedding import QuantizedEmbedding
    
    table = QuantizedEmbedding(torch.randn(1 << 19, 128, dtype=torch.bfloat16), EmbeddingQuant(bits, 32, symmetric=False))  # fp32: 256 MB
    ids = torch.tensor([[5, 7, 5, 100_000, 0, (1 << 19) - 1]])

    ref, ref_extra = peak_extra_mb(lambda: table(ids))
    with row_gather_lookups():
        got, got_extra = peak_extra_mb(lambda: table(ids))
    assert torch.equal(got, ref)
    assert got_extra < 32 < 200 < ref_extra, (got_extra, ref_extra)
    assert peak_extra_mb(lambda: table(ids))[1] > 200  # the reference kernel is back after the block


def test_chunked_weight_quantization_equals_reference_with_bounded_temporaries():
    """Folding a weight's quantization (convert_pt2e) with torch's reference kernel makes several full-size fp32
    temporaries (3 GB for Gemma-4-E2B's lm_head); the chunked kernel gives the same integers."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (defines quantized_decomposed::quantize_per_channel)

    from optimum_qnn.quantization.kernels import chunked_weight_quantization

    w = torch.randn(1 << 18, 512)  # 512 MB
    scales = w.abs().amax(1) / 7
    zeros = torch.zeros(w.shape[0], dtype=torch.int64)
    op = torch.ops.quantized_decomposed.quantize_per_channel

    ref, ref_extra = peak_extra_mb(lambda: op(w, scales, zeros, 0, -8, 7, torch.int8))
    with chunked_weight_quantization():
        got, got_extra = peak_extra_mb(lambda: op(w, scales, zeros, 0, -8, 7, torch.int8))
        other_axis = op(w[:1024], torch.ones(512), torch.zeros(512, dtype=torch.int64), 1, -8, 7, torch.int8)
    assert torch.equal(got, ref) and got.dtype == torch.int8
    # The reference holds two full-size fp32 temporaries (2 x 512 MB); RSS growth under-counts them by whatever pages
    # earlier frees left resident (measured 999.97 MB once), so the bound is one and a half of them.
    assert got_extra < 400 < 768 < ref_extra, (got_extra, ref_extra)
    torch.testing.assert_close(other_axis, op(w[:1024], torch.ones(512), torch.zeros(512, dtype=torch.int64), 1, -8, 7, torch.int8))


def test_chunked_block_quantization_equals_reference_with_bounded_temporaries():
    """The same for `torchao::quantize_affine`, the block-wise (LPBQ) weights of `16a4w_block`, whose reference makes
    full-size fp32 temporaries of the whole weight."""
    import torchao.quantization.quant_primitives  # noqa: F401  (defines torchao::quantize_affine)

    from optimum_qnn.quantization.kernels import chunked_weight_quantization

    w = torch.randn(1 << 18, 512)  # 512 MB
    scales = w.view(w.shape[0], 8, 64).abs().amax(-1) / 7
    zeros = torch.zeros(scales.shape, dtype=torch.int32)
    op = torch.ops.torchao.quantize_affine

    ref, ref_extra = peak_extra_mb(lambda: op(w, [1, 64], scales, zeros, torch.int8, -8, 7))
    with chunked_weight_quantization():
        got, got_extra = peak_extra_mb(lambda: op(w, [1, 64], scales, zeros, torch.int8, -8, 7))
        whole = op(w[:64], [64, 64], scales[:1].clone(), zeros[:1].clone(), torch.int8, -8, 7)  # one scale per 64 rows
    assert torch.equal(got, ref) and got.dtype == torch.int8
    assert got_extra < 400 < 768 < ref_extra, (got_extra, ref_extra)
    assert torch.equal(whole, torch.ops.torchao.quantize_affine(w[:64], [64, 64], scales[:1].clone(), zeros[:1].clone(), torch.int8, -8, 7))


# --- quantizer arguments and LPBQ block sizes ---------------------------------------------------------------


def test_make_quantizer_rejects_bad_arguments(qnn_sdk):
    from optimum_qnn.quantization.pt2e import make_quantizer

    with pytest.raises(ValueError, match="not a PT2E scheme"):
        make_quantizer(QuantScheme.FP16)
    with pytest.raises(ValueError, match="Unknown quant scheme 'int3'"):
        make_quantizer("int3")
    with pytest.raises(ValueError, match="Unknown quant scheme"):
        make_quantizer("16a8w", overrides={"lm_head": "int3"})
    with pytest.raises(ValueError, match="Block size must be positive"):
        make_quantizer("16a4w_block", block_size=0)


def test_lpbq_block_size():
    from optimum_qnn.quantization.pt2e import lpbq_block_size

    assert lpbq_block_size(1536, 64) == 64  # Gemma4 E2B hidden size: 24 blocks
    assert lpbq_block_size(384, 64) == 64  # 6 blocks run
    assert lpbq_block_size(640, 64) == 64  # 10 blocks run
    for crash in (448, 512, 576):  # 7-9 blocks of 64 crash the emulator
        assert lpbq_block_size(crash, 64) == 32
    assert lpbq_block_size(256, 32) == 32  # 8 blocks of 32 run
    assert lpbq_block_size(96, 64) == 32  # 64 does not divide 96
    assert lpbq_block_size(8, 64) is None  # neither divides: per-channel


def test_lpbq_scales_are_representable():
    from optimum_qnn.quantization.pt2e import _lpbq_scales

    scale = torch.rand(16, 12) + 1e-3
    lpbq = _lpbq_scales(scale)
    unit = scale.amax(dim=1, keepdim=True) / 16
    steps = lpbq / unit
    assert torch.allclose(steps, steps.round(), atol=1e-4)
    assert steps.min() >= 1 - 1e-4 and steps.max() <= 16 + 1e-4
    assert (lpbq >= scale * (1 - 1e-6)).all()  # rounded up: no weight gets clipped
