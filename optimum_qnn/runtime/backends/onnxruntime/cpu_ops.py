"""The CPU-side kernels of our programs, in numpy, bit-exact with ExecuTorch's.

What an export leaves outside its QNN delegates is small: the token and per-layer embedding lookups before the
first delegate (weight-only quantized, `quantized_decomposed::embedding_byte` / `embedding_4bit`, or float
`aten::embedding` when the tables stay float), and `llama::fallback`, the identity op ExecuTorch's sharding puts
between two shards' delegates. Each kernel here reproduces the ExecuTorch 1.5.1 kernel's arithmetic (read from
`kernels/quantized/cpu/op_embedding.cpp` and `embeddingxb.cpp`): the weight as float32, minus the zero point as
float32, times the scale as float32, one rounding, then cast to the output dtype. numpy's float32 multiply rounds
the same way, so the outputs are the same bytes.

A kernel is called with the method's value table and the instruction's args (ExecuTorch's convention: the schema's
arguments, the `out` tensor, then the returned value, which is the same value index as `out`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from optimum_qnn.errors import InvalidInputError

Kernel = Callable[[list, Sequence[int]], None]

def _dequantized_rows(rows: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, out_dtype) -> np.ndarray:
    """`rows` [n, dim] of integer weights -> [n, dim] of `out_dtype`, grouped as `scales` [n, groups] says."""
    n, dim = rows.shape
    groups = scales.shape[1] if scales.ndim == 2 else 1
    w = rows.astype(np.float32).reshape(n, groups, dim // groups)
    if zero_points is not None:
        w = w - zero_points.reshape(n, groups, 1).astype(np.float32)
    out = w * scales.reshape(n, groups, 1).astype(np.float32)
    return out.reshape(n, dim).astype(out_dtype, copy=False)


def _lookup(indices: np.ndarray, table_rows: int) -> np.ndarray:
    flat = indices.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= table_rows):
        bad = flat[(flat < 0) | (flat >= table_rows)][0]
        # ExecuTorch's kernel aborts the process here (ET_CHECK); a caller gets an error instead.
        raise InvalidInputError(f"token id {bad} is outside the embedding table's {table_rows} rows")
    return flat


def _unpack_4bit(packed: np.ndarray) -> np.ndarray:
    """uint8 [n, dim/2] -> int8 [n, dim]: even columns in the high nibble, odd in the low, minus 8 (embeddingxb.cpp)."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int8)
    out[:, 0::2] = (packed >> 4).astype(np.int8) - 8
    out[:, 1::2] = (packed & 0x0F).astype(np.int8) - 8
    return out


def _embedding_quantized(bits: int, with_dtype: bool) -> Kernel:
    def kernel(values: list, args: Sequence[int]) -> None:
        weight, scales, zero_points = values[args[0]], values[args[1]], values[args[2]]
        indices = values[args[5]]
        out_index = args[7] if with_dtype else args[6]
        out_spec = values[out_index]
        flat = _lookup(indices, weight.shape[0])
        rows = weight[flat]
        if bits == 4:
            rows = _unpack_4bit(rows)
        zp = None if zero_points is None else zero_points[flat]
        result = _dequantized_rows(rows, scales[flat], zp, out_spec.dtype).reshape(out_spec.shape)
        values[out_index] = values[args[-1]] = result

    return kernel


def _embedding_float(values: list, args: Sequence[int]) -> None:
    """aten::embedding.out(weight, indices, padding_idx, scale_grad_by_freq, sparse, *, out): a row copy."""
    weight, indices = values[args[0]], values[args[1]]
    out_spec = values[args[5]]
    result = weight[_lookup(indices, weight.shape[0])].reshape(out_spec.shape)
    values[args[5]] = values[args[-1]] = result


def _identity(values: list, args: Sequence[int]) -> None:
    """llama::fallback.out(input, *, out), and copy-like ops whose output has the input's bytes and shape."""
    source, out_spec = values[args[0]], values[args[1]]
    values[args[1]] = values[args[-1]] = np.asarray(source).reshape(out_spec.shape)


KERNELS: dict[str, Kernel] = {
    "quantized_decomposed::embedding_byte.out": _embedding_quantized(8, with_dtype=False),
    "quantized_decomposed::embedding_byte.dtype_out": _embedding_quantized(8, with_dtype=True),
    "quantized_decomposed::embedding_4bit.out": _embedding_quantized(4, with_dtype=False),
    "quantized_decomposed::embedding_4bit.dtype_out": _embedding_quantized(4, with_dtype=True),
    "aten::embedding.out": _embedding_float,
    "llama::fallback.out": _identity,
}


def missing_kernels(operators: Sequence[str], used: Sequence[int]) -> list[str]:
    """The operators among `used` (indices into `operators`) that this module cannot run, in first-use order."""
    missing: list[str] = []
    for index in used:
        name = operators[index]
        if name not in KERNELS and name not in missing:
            missing.append(name)
    return missing


def output_spec(value: Any) -> "OutSpec":
    """What a kernel needs to know of an output value it will replace: its numpy dtype and shape."""
    return OutSpec(np.dtype(value.dtype), tuple(value.sizes))


class OutSpec:
    """An output slot before its first write: its dtype and shape (kernels replace it with their result)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]):
        self.dtype, self.shape = dtype, shape
