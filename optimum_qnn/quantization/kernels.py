"""Memory-lean eager CPU kernels for reference ops that the export runs on whole weight tables.

The Python reference kernels of a few quantization ops materialise float copies of an entire table per call:
ExecuTorch's quantized embedding lookups dequantize the whole table (Gemma-4-E2B's per-layer table: 9.4 GB in
fp32) at every calibration step, and torch's `quantize_per_channel` makes several full-size fp32 temporaries of the
weight it folds (3 GB for E2B's 262144 x 1536 lm_head). The kernels here call the same reference code on the rows
that matter, so results are identical, and are registered for the CPU dispatch key (ahead of the references'
CompositeExplicitAutograd one) only inside a `with` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch

_ROWS_PER_CHUNK_ELEMENTS = 1 << 22  # per-channel quantization runs on about 4 M values at a time (16 MB fp32)


@contextlib.contextmanager
def cpu_kernels(namespace: str, kernels: Mapping[str, Callable]) -> Iterator[None]:
    """Register `kernels` (overload name -> function) for the CPU key of `namespace` ops within the block."""
    lib = torch.library.Library(namespace, "IMPL")
    try:
        for name, kernel in kernels.items():
            lib.impl(name, kernel, "CPU")
        yield
    finally:
        lib._destroy()


def row_gather_lookups() -> contextlib.AbstractContextManager:
    """Quantized embedding lookups that dequantize only the rows they look up."""
    from optimum_qnn.quantization.embedding import register_quantized_embedding_ops

    register_quantized_embedding_ops()
    from executorch.exir.passes import _quant_patterns_and_replacements as reference

    return cpu_kernels("quantized_decomposed", {
        "embedding_4bit.dtype": _on_gathered_rows(reference.embedding_4bit_dtype),
        "embedding_byte.dtype": _on_gathered_rows(reference.embedding_byte_dtype),
    })


def _on_gathered_rows(kernel: Callable) -> Callable:
    def lookup(weight, scales, zero_points, quant_min, quant_max, indices, dtype=None):
        rows, inverse = torch.unique(indices.reshape(-1), return_inverse=True)
        scales = scales[rows]
        if zero_points is None and scales.dtype != torch.float32:
            # ExecuTorch's C++ kernel multiplies in float32; the reference would round the products to fp16.
            scales = scales.to(torch.float32)
        zero_points = None if zero_points is None else zero_points[rows]
        return kernel(weight[rows], scales, zero_points, quant_min, quant_max, inverse.view(indices.shape), dtype)

    return lookup


_CHUNKED: set = set()  # the op packets whose chunked kernels are registered now (within `chunked_weight_quantization`)


def casts_chunks(op) -> bool:
    """Whether ``op`` is one whose kernel within `chunked_weight_quantization` takes a bf16 / fp16 weight and casts it
    to fp32 one chunk of rows at a time (`folding._quantize_stored`: no fp32 copy of the whole weight)."""
    return getattr(op, "overloadpacket", op) in _CHUNKED


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """A weight kept in its stored dtype, cast as the graph's cast would (exact); fp32 as it is."""
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def chunked_weight_quantization() -> contextlib.AbstractContextManager:
    """`quantized_decomposed::quantize_per_channel` along axis 0 (a linear's output channels) and `torchao::quantize_affine`
    with per-row blocks in row chunks; a bf16 / fp16 input (a stored-dtype weight) is cast to fp32 chunk by chunk."""
    from torch.ao.quantization.fx import _decomposed as reference

    def quantize_per_channel(input, scales, zero_points, axis, quant_min, quant_max, dtype):
        if axis != 0 or input.shape[0] <= _chunk_rows(input):
            return reference.quantize_per_channel(_fp32(input), scales, zero_points, axis, quant_min, quant_max, dtype)
        return _in_row_chunks(input, dtype, lambda rows: reference.quantize_per_channel(
            _fp32(input[rows]), scales[rows], zero_points[rows], 0, quant_min, quant_max, dtype))

    return _registered(
        {torch.ops.quantized_decomposed.quantize_per_channel, torch.ops.torchao.quantize_affine},
        cpu_kernels("quantized_decomposed", {"quantize_per_channel": quantize_per_channel}),
        cpu_kernels("torchao", {"quantize_affine": _chunked_quantize_affine}),
    )


@contextlib.contextmanager
def _registered(ops: set, first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> Iterator[None]:
    with first, second:
        added = ops - _CHUNKED
        _CHUNKED.update(added)
        try:
            yield
        finally:
            _CHUNKED.difference_update(added)


def _chunked_quantize_affine(input, block_size, scale, zero_point, output_dtype, quant_min=None, quant_max=None):
    """`torchao::quantize_affine` (the block-wise weights of `16a4w_block`) in row chunks when every row has its own
    scales (block_size[0] == 1): torchao's reference makes several fp32 temporaries of the whole weight (the lm_head:
    1.6 GB each at E2B widths)."""
    from torchao.quantization import quant_primitives as reference

    qmin, qmax = reference._get_and_check_qmin_qmax(output_dtype, quant_min, quant_max)
    dtype = torch.uint8 if output_dtype in reference._SUB_BYTE_UINT_BOUNDS else output_dtype

    def quantize(x, s, z):  # the body of torchao's `_quantize_affine` (calling the op would come back here)
        return reference._quantize_affine_no_dtype_cast(x, block_size, s, z, qmin, qmax).to(dtype)

    per_row = input.dim() >= 2 and block_size[0] == 1 and scale.dim() >= 1 and scale.shape[0] == input.shape[0]
    per_row = per_row and (zero_point is None or zero_point.shape[:1] == scale.shape[:1])
    if not per_row or input.shape[0] <= _chunk_rows(input):
        return quantize(_fp32(input), scale, zero_point)
    return _in_row_chunks(input, dtype, lambda rows: quantize(
        _fp32(input[rows]), scale[rows], None if zero_point is None else zero_point[rows]))


def _chunk_rows(input: torch.Tensor) -> int:
    """Rows of `input` per chunk: about `_ROWS_PER_CHUNK_ELEMENTS` values."""
    return max(1, _ROWS_PER_CHUNK_ELEMENTS // max(1, input[0].numel())) if input.dim() else 1


def _in_row_chunks(input: torch.Tensor, dtype: torch.dtype, quantize_rows: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """The quantized `input`, `quantize_rows(rows)` computing each chunk of rows (a slice along dim 0)."""
    out = torch.empty(input.shape, dtype=dtype)
    step = _chunk_rows(input)
    for start in range(0, input.shape[0], step):
        rows = slice(start, start + step)
        out[rows] = quantize_rows(rows)
    return out
