"""CPU-side embedding lookups of the exported graph: weight-only quantized (4-bit group-wise or 8-bit) or float.

The token and per-layer embedding tables never enter the HTP graph (Gemma4 E2B's per-layer table alone is
262144 x 8960): the lookups call ExecuTorch's ``quantized_decomposed::embedding_{4bit,byte}`` kernels on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from optimum_qnn.config import EmbeddingQuant
from optimum_qnn.quantization.weights import release_pages, return_free_heap, try_map_to_file


def register_quantized_embedding_ops() -> None:
    # Defines quantized_decomposed::embedding_{byte,4bit}{,.dtype,.out,.dtype_out} with Python reference
    # kernels, which torch.export needs to trace QuantizedEmbedding (torchao does not define these).
    import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401


_ROW_CHUNK_ELEMENTS = 1 << 24  # rows are quantized in chunks of about 16 M values (64 MB in fp32)


class QuantizedEmbedding(nn.Module):
    """An embedding lookup for the CPU side of the graph: weight-only quantized (4-bit or 8-bit) or float.

    Quantization is per group of `group_size` columns (`group_size=0`: per row): symmetric with fp16 scales and no
    zero points (`quant.symmetric`, the default), or asymmetric with scales and zero points in `out_dtype`. The forward calls `quantized_decomposed::embedding_4bit.dtype` (two 4-bit
    values per byte, the layout ExecuTorch's kernel unpacks) or `embedding_byte.dtype`; the QNN partitioner
    does not take either, so they run on the CPU (import `executorch.kernels.quantized` before loading the .pte).
    The float variant (`bits=0`) is a plain `aten.embedding`, which `make_quantizer` never annotates; keep it
    off the HTP when lowering (skip op `aten.embedding.default`).

    The table is quantized row chunk by row chunk from its stored dtype (e.g. bf16), so no fp32 copy of a large
    table (Gemma4 E2B's per-layer table is 262144 x 8960) is ever materialised.

    Args:
        weight: the `[num_embeddings, embedding_dim]` table, any floating dtype.
        quant: bits (0, 4, 8) and group size.
        out_dtype: dtype of the looked-up rows, and of the asymmetric form's scales and zero points (ExecuTorch's
            kernel wants zero points in the output dtype, its reference op wants them in the scales' dtype). The
            kernel reads fp16 scales for any output dtype, as long as there are no zero points.

    Example:
        >>> emb = QuantizedEmbedding(model.embed_tokens.weight, EmbeddingQuant(bits=4, group_size=32))
        >>> hidden = emb(input_ids)  # [1, T, embedding_dim] float32
    """

    def __init__(
        self,
        weight: torch.Tensor,
        quant: EmbeddingQuant,
        *,
        out_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"Expected a 2-D floating embedding table; got {tuple(weight.shape)} {weight.dtype}")
        self.bits = quant.bits
        self.num_embeddings, self.embedding_dim = weight.shape
        self.out_dtype = out_dtype
        self.symmetric = quant.symmetric
        if self.bits == 0:
            self.group_size = 0
            self.register_buffer("weight", weight.detach().to(out_dtype).clone())
            return
        register_quantized_embedding_ops()
        group = quant.group_size or self.embedding_dim
        if self.embedding_dim % group:
            raise ValueError(f"Embedding dim {self.embedding_dim} is not a multiple of the group size {group}")
        if self.bits == 4 and self.embedding_dim % 2:
            raise ValueError(f"4-bit embeddings pack two values per byte; embedding dim {self.embedding_dim} is odd")
        self.group_size = group
        self.qmin, self.qmax = -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1
        packed_cols = self.embedding_dim // 2 if self.bits == 4 else self.embedding_dim
        packed = torch.empty(self.num_embeddings, packed_cols, dtype=torch.uint8 if self.bits == 4 else torch.int8)
        groups = self.embedding_dim // group
        scale_dtype = torch.float16 if self.symmetric else out_dtype
        scales = torch.empty(self.num_embeddings, groups, dtype=scale_dtype)
        zero_points = None if self.symmetric else torch.empty(self.num_embeddings, groups, dtype=out_dtype)
        rows = max(1, _ROW_CHUNK_ELEMENTS // self.embedding_dim)
        with torch.no_grad():
            for start in range(0, self.num_embeddings, rows):
                stop = min(start + rows, self.num_embeddings)
                chunk = weight[start:stop]
                q, s, z = self._symmetric_rows(chunk) if self.symmetric else self._quantize_rows(chunk, out_dtype)
                release_pages(chunk)  # a table mapped from its checkpoint does not stay resident
                scales[start:stop] = s
                if zero_points is not None:
                    zero_points[start:stop] = z
                if self.bits == 4:
                    # byte = (even + 8) << 4 | (odd + 8): the unpacking of embedding_4bit
                    u = (q + 8).to(torch.uint8).view(stop - start, -1, 2)
                    packed[start:stop] = (u[..., 0] << 4) | u[..., 1]
                else:
                    packed[start:stop] = q.to(torch.int8)
        self.register_buffer("weight", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zero_points", zero_points)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, quant: EmbeddingQuant, **kwargs) -> "QuantizedEmbedding":
        """Build from an `nn.Embedding` (its weight is read, not kept)."""
        return cls(embedding.weight, quant, **kwargs)

    def _quantize_rows(self, chunk: torch.Tensor, scale_dtype: torch.dtype):
        n = chunk.shape[0]
        w = chunk.to(torch.float32).view(n, -1, self.group_size)
        lo = w.amin(dim=-1).clamp(max=0.0)
        hi = w.amax(dim=-1).clamp(min=0.0)
        # The stored (rounded) scale is the one used to quantize, so dequantization is consistent.
        scale = ((hi - lo) / (self.qmax - self.qmin)).clamp(min=1e-8).to(scale_dtype)
        s = scale.to(torch.float32)
        zero = torch.clamp(self.qmin - torch.round(lo / s), self.qmin, self.qmax)
        # The kernels compute (q - zero_point) * scale with q in [qmin, qmax].
        q = torch.clamp(torch.round(w / s.unsqueeze(-1)) + zero.unsqueeze(-1), self.qmin, self.qmax)
        return q.to(torch.int16).view(n, -1), scale, zero.to(scale_dtype)

    def _symmetric_rows(self, chunk: torch.Tensor):
        n = chunk.shape[0]
        w = chunk.to(torch.float32).view(n, -1, self.group_size)
        # The widest scale of the two ends: -qmin steps below zero, qmax above.
        scale = torch.maximum(w.amin(dim=-1) / self.qmin, w.amax(dim=-1) / self.qmax)
        if not torch.isfinite(scale).all() or scale.max() > torch.finfo(torch.float16).max:
            raise ValueError(
                "An embedding table holds values beyond what fp16 scales represent (or non-finite values); quantize "
                "it with zero points and float32 scales (--embedding-quant BITS,GROUP,asym) or keep it float ('none')"
            )
        # The stored (rounded) scale is the one used to quantize; fp16 subnormals are kept (the kernel reads them).
        scale = scale.clamp(min=torch.finfo(torch.float16).smallest_normal * 2.0**-10).to(torch.float16)
        q = torch.clamp(torch.round(w / scale.to(torch.float32).unsqueeze(-1)), self.qmin, self.qmax)
        return q.to(torch.int16).view(n, -1), scale, None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.bits == 0:
            return nn.functional.embedding(input_ids, self.weight)
        ops = torch.ops.quantized_decomposed
        op = ops.embedding_4bit if self.bits == 4 else ops.embedding_byte
        return op.dtype(
            self.weight, self.scales, self.zero_points, self.qmin, self.qmax, input_ids, dtype=self.out_dtype
        )

    def dequantized_weight(self) -> torch.Tensor:
        """The full table as the lookup sees it, in `out_dtype` (for tests; materialises the table)."""
        return self(torch.arange(self.num_embeddings))

    def extra_repr(self) -> str:
        quant = f"bits={self.bits}, group_size={self.group_size}, symmetric={self.symmetric}" if self.bits else "float"
        return f"{self.num_embeddings}, {self.embedding_dim}, {quant}"


def map_tables_to_file(modules, path) -> int:
    """Move the tables of ``modules`` (`QuantizedEmbedding`s) out of anonymous memory into a file mapping
    (`weights.map_to_file`, at ``path`` on the export's own file system).

    The export touches a table when it calibrates (the looked-up rows) and when it writes the program. Gemma-4-E4B's
    quantized tables are 1.8 GiB; its lowering's first compile was killed for memory in a 16 GB cgroup while the main
    process held them. Returns the bytes moved; 0, with the tables left where they were, if the file cannot be
    written (a full disk, say)."""
    owners = {}
    for i, module in enumerate(modules):
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.numel():
                owners[f"{i}.{name}"] = (module, name, buffer.contiguous())
    if not owners:
        return 0
    mapped = try_map_to_file({key: buffer for key, (_, _, buffer) in owners.items()}, path, "The embedding tables")
    if mapped is None:
        return 0
    for key, (module, name, _) in owners.items():
        module._buffers[name] = mapped[key]
    del owners
    return_free_heap()  # glibc keeps freed blocks under its mmap threshold (up to 32 MB) in its heap: give them back
    return sum(t.nbytes for t in mapped.values())
