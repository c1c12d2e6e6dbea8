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
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from optimum_qnn.native_output import c_library

logger = logging.getLogger(__name__)

_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the pages; file-backed ones are re-read on the next touch
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def release_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to reclaim the pages under ``tensor``'s data (non-destructive: a file-backed page is read
    again from the file when touched, an anonymous one stays or goes to swap). Returns whether the call was made.

    For a tensor that maps a checkpoint file (safetensors), this drops it from the process's RSS after a pass."""
    if not tensor.numel() or not hasattr(os, "sysconf"):
        return False
    try:
        start = tensor.data_ptr() // _PAGE * _PAGE
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        return c_library().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_PAGEOUT) == 0
    except AttributeError:  # no C library or no madvise (not Linux): the pages stay, nothing else changes
        return False


def _file_backed_ranges() -> list[tuple[int, int]]:
    """The address ranges of this process's file-backed mappings (Linux /proc/self/maps; empty elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and fields[4] != "0":  # an inode: a file's pages, which the kernel can drop
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        pass
    return ranges


def anonymous_tensors(tensors: Mapping[str, torch.Tensor], min_bytes: int = 0) -> dict[str, torch.Tensor]:
    """Those of ``tensors`` (of at least ``min_bytes``) whose data is in anonymous memory and alone in its storage:
    what `map_to_file` can move. A tensor in a file mapping already (a checkpoint's pages, a table mapped before)
    or a view into a larger storage is left out."""
    ranges = _file_backed_ranges()
    out = {}
    for key, tensor in tensors.items():
        if tensor.nbytes < max(min_bytes, 1) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            continue
        if any(start <= tensor.data_ptr() < end for start, end in ranges):
            continue
        out[key] = tensor
    return out


def map_to_file(tensors: Mapping[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """The same values as ``tensors``, in a private mapping of a file written at ``path`` and deleted at once.

    Where they live changes, not what they hold: pages the kernel can drop and read again from the file (its blocks
    stay until the mapping goes with the last tensor that views it) instead of anonymous memory that counts against
    the export for as long as the tensors live. The mapping is private and writable, so a tensor written in place
    copies the page it writes and the file is never changed. ``path`` must be on a disk's file system (never a
    RAM-backed /tmp): the export's own output folder. Raises OSError when the file cannot be written (nothing is
    left then); `try_map_to_file` warns instead."""
    import mmap

    path = Path(path)
    offsets = {}
    try:
        with open(path, "wb") as file:
            for key, tensor in tensors.items():
                file.write(b"\0" * (-file.tell() % 64))  # aligned for every element type
                offsets[key] = file.tell()
                file.write(tensor.detach().reshape(-1).view(torch.uint8).numpy().data)
            size = file.tell()
        if not size:
            return {}
        with open(path, "r+b") as file:
            mapping = mmap.mmap(file.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        path.unlink(missing_ok=True)
    # each tensor keeps the mapping alive; the last one to go unmaps it
    return {key: torch.frombuffer(mapping, dtype=t.dtype, count=t.numel(), offset=offsets[key]).view(t.shape)
            for key, t in tensors.items()}


def try_map_to_file(tensors: Mapping[str, torch.Tensor], path: Path, what: str) -> dict[str, torch.Tensor] | None:
    """`map_to_file`, or None with one warning line saying that ``what`` stays in memory when the file cannot be
    written (a full disk, say): the export goes on with the tensors where they were."""
    try:
        return map_to_file(tensors, path)
    except OSError as error:
        # the text only: a record holding the error would keep its traceback, and with it the tensors, alive
        logger.warning("%s stay in memory: writing them to %s failed (%s)", what, path, str(error))
        return None


def return_free_heap() -> float:
    """Hand the C heap's free pages back to the kernel (glibc's `malloc_trim`); returns the GB this process's RSS
    fell by (0 where there is no glibc).

    glibc keeps the memory a process frees inside its heap, for reuse, unless it lies at the heap's top; tensors
    smaller than its mmap threshold (which rises to 32 MB as large blocks are freed) live there. Calibration and the
    weight fold free GBs of such temporaries and the lowering does not reuse them all: measured on the full-size
    Gemma-4-E4B (16a4w_block, 42 shards) when the lowering began, 6.91 GiB of live tensors in an RSS of 9.85 GiB, and
    7.68 GiB after one trim. The compile workers are forked from this process, and its RSS counts against the
    export's memory budget: the lowering trims when it starts and before each shard's compile is forked."""
    trim = getattr(c_library(), "malloc_trim", None)  # musl and macOS have none
    if trim is None:
        return 0.0
    before = rss_kb()
    trim(0)
    return max(0, before - rss_kb()) / 2**20


def rss_kb() -> int:
    """This process's resident set, in kB (/proc/self/statm)."""
    return resident_kb()[0]


def resident_kb() -> tuple[int, int]:
    """This process's resident set and its anonymous part (less the file-backed and shmem pages: statm's third
    field), in kB. File pages are clean copies of files the kernel drops and reads again under pressure."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
    return int(fields[1]) * page_kb, (int(fields[1]) - int(fields[2])) * page_kb


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
