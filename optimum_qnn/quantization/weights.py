"""Weights kept in their stored dtype and in the checkpoint's pages until the quantizer needs them.

A quantized export never computes with the float weights after calibration: it reads each one to observe and to
quantize it, and lowering carries only the integer copies. Holding every matrix as fp32 (7.4 GB for
Gemma-4-E2B's decoder, 1.6 GB for its lm_head) was most of the export's peak memory. Instead:

- the checkpoint's matrices stay as loaded: bf16 tensors backed by the safetensors file's pages (safetensors maps
  the file; a page is read when touched and the kernel may drop it again);
- each `nn.Linear` of the static graph becomes an `UpcastLinear`, whose graph casts its weight to the activations'
  dtype (fp32). The cast of a bf16 value to fp32 is exact, so the graph computes what it computed with fp32
  weights; PT2E observes and quantizes the cast weight, and the constant folding of the quantization
  (`folding.fold_weight_quantization`) folds the cast with it, so no cast is left in the converted graph;
- `release_pages` hands a tensor's file-backed pages back to the kernel once a pass over it is done (the
  embedding tables are quantized row chunk by row chunk, and none of their bf16 pages stays resident).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the pages; file-backed ones are re-read on the next touch
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc = None


def release_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to reclaim the pages under ``tensor``'s data (non-destructive: a file-backed page is read
    again from the file when touched, an anonymous one stays or goes to swap). Returns whether the call was made.

    For a tensor that maps a checkpoint file (safetensors), this drops it from the process's RSS after a pass."""
    global _libc
    if not tensor.numel() or not hasattr(os, "sysconf"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        start = tensor.data_ptr() // _PAGE * _PAGE
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_PAGEOUT) == 0
    except (OSError, AttributeError):  # no madvise (not Linux): the pages stay, nothing else changes
        return False


class UpcastLinear(nn.Module):
    """`nn.Linear` whose weight (and bias) stay in their stored dtype; the graph casts them to the input's dtype.

    Adopts the Linear's parameters (the same tensor objects), so module paths, ties (lm_head to the token table)
    and quantization overrides by module name are unchanged."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={self.weight.dtype}"


def upcast_in_graph(module: nn.Module, keep: tuple[type[nn.Module], ...] = ()) -> int:
    """Replace every `nn.Linear` of ``module`` whose weight is not fp32 by an `UpcastLinear`, and convert every
    other floating parameter or buffer that is not fp32 to fp32 (norm scales and the like: small), except those of
    modules of the ``keep`` types (e.g. quantized embedding tables). Returns the bytes left in the stored dtype."""
    kept, skip = 0, set()
    for child in list(module.modules()):
        if isinstance(child, (*keep, UpcastLinear)):
            skip |= {id(t) for t in [*child.parameters(), *child.buffers()]}
            continue
        for attr, sub in list(child.named_children()):
            if type(sub) is nn.Linear and sub.weight.dtype != torch.float32:
                setattr(child, attr, UpcastLinear(sub))
                kept += sub.weight.nbytes
                skip |= {id(t) for t in sub.parameters()}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in skip and tensor.is_floating_point() and tensor.dtype != torch.float32:
            tensor.data = tensor.data.to(torch.float32)
    logger.info("%.0f MB of linear weights stay in their stored dtype until quantized", kept / 2**20)
    return kept
