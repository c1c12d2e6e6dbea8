"""What a `.pte` really holds: its QNN context binaries, read back with the QNN System library.

Per context: the SoC and HTP arch it was compiled for, the QAIRT build, its graphs with their inputs and outputs
(names, dtypes, shapes, quantization encodings), how many bytes of weights it stores shared between its graphs
and how many each graph keeps for itself, and its size. `compare_builds` checks that a weight-shared build (the
phone's) holds what the non-shared build (the one the x86 emulator can run and the tests check) holds.

Runtime code: imports neither the exporter nor `torch.export` (`pte.py` reads the flatbuffer itself).

Example:
    >>> from optimum_qnn.artifacts.inspection import inspect_pte
    >>> report = inspect_pte("out/qnn/sm8650/16a8w-ctx1024/model.pte")
    >>> print(report.to_text())
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimum_qnn.config import Soc
from optimum_qnn.artifacts.inspection.pte import QnnDelegate, qnn_delegates
from optimum_qnn.artifacts.inspection.qnn_system import BinaryInfo, Encoding, QnnInspectError, QnnSystem, TensorInfo
from optimum_qnn.artifacts.manifest import Inspection, QnnContext, QnnGraph, QnnTensor, SharingCheck

__all__ = [
    "ContextReport", "GraphReport", "PteReport", "QnnInspectError", "compare_builds", "context_load_bytes",
    "graph_load_bytes", "program_load_bytes", "SharingCheck", "export_time_inspection", "inspect_bytes", "inspect_pte", "manifest_inspection",
]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class GraphReport:
    """One graph of a context.

    Args:
        const_bytes: constant data the graph keeps for itself (its own copy of weights when not shared).
        shared_weights_bytes: weights it reads from the context's shared pool (HTP graph blob info v2).
        spill_fill_bytes: the spill-fill buffer the graph needs in DDR (HTP graph blob info v1; 0 when none).
        io_bytes: its input and output tensors' memory (blob info v2).
        op_data_bytes: its operators' own data, the activations it keeps (blob info v2).
    """

    name: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    const_bytes: int | None
    shared_weights_bytes: int | None
    spill_fill_bytes: int | None = None
    io_bytes: int | None = None
    op_data_bytes: int | None = None


@dataclass(frozen=True)
class ContextReport:
    """One QNN context binary of a `.pte`.

    Args:
        delegates: the `method[index]` delegates that run it (several when the methods' graphs share a context).
        size: bytes of the context binary.
        soc: the SoC it was compiled for (QNN's SoC model id mapped to a name; `id <n>` when unknown here).
        htp_arch: the Hexagon arch it was compiled for (HTP context metadata, else the compile spec).
        weight_sharing: whether its graphs share one copy of their weights (the compile option).
        shared_weights_bytes: the shared weight pool's size (0 when not shared).
        const_bytes: constant data kept per graph, summed over the graphs.
    """

    delegates: list[str]
    size: int
    build_id: str
    soc: str
    htp_arch: int | None
    weight_sharing: bool | None
    shared_weights_bytes: int
    const_bytes: int
    context_blob_size: int
    graphs: list[GraphReport]


@dataclass(frozen=True)
class PteReport:
    path: str
    size: int
    contexts: list[ContextReport]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_text(self) -> str:
        return format_report(self)


@dataclass(frozen=True)
class _HtpGraphSizes:
    const: int | None = None
    shared: int | None = None
    spill_fill: int | None = None
    io: int | None = None
    op_data: int | None = None


def _htp_graph_sizes(blob: bytes) -> _HtpGraphSizes:
    """The sizes of an HTP graph info blob (QnnHtpSystemContext.h): a v1 record (version, spill-fill buffer size,
    VTCM size, optimization level, DLBC, HVX threads; 40 bytes) followed by a v2 record (version, K/V tile sizes,
    safe-share flag, io, op data, const, DDR tensor and shared weight sizes); None where a record is missing."""
    v1, v1_size, v2 = struct.Struct("<I4xQ"), 40, struct.Struct("<I4xQQI4xQQQQQ")
    spill = v1.unpack_from(blob)[1] if len(blob) >= v1_size and struct.unpack_from("<I", blob)[0] == 1 else None
    if len(blob) < v1_size + v2.size or struct.unpack_from("<I", blob, v1_size)[0] != 2:
        return _HtpGraphSizes(spill_fill=spill)
    *_, io, op_data, const, _ddr, shared = v2.unpack_from(blob, v1_size)
    return _HtpGraphSizes(const, shared, spill, io, op_data)


def graph_load_bytes(blob: bytes) -> int:
    """The HTP memory QNN reserves for one graph when it loads its context, from the graph's info blob: its own
    constants, IO tensors, spill-fill buffer and op data (QNN's own estimate, printed at verbose level, counts the
    same constants, IO and spill-fill and a "runlist" of 1.6x the op data on Gemma-4-E2B's graphs: within 1 % of
    this). Weights shared between graphs are not counted (the emulator cannot load such contexts)."""
    sizes = _htp_graph_sizes(blob)
    return _load_bytes(sizes.const, sizes.io, sizes.spill_fill, sizes.op_data)


def _load_bytes(const: int | None, io: int | None, spill_fill: int | None, op_data: int | None) -> int:
    """One graph's share of what QNN reserves to load its context (`graph_load_bytes`); a missing size counts 0."""
    return sum(n or 0 for n in (const, io, spill_fill, op_data))


def _htp_arch(metadata: bytes) -> int | None:
    """The DSP arch from HTP context metadata (`QnnHtpSystemContext_ContextBlobInfo_t` v1), or None."""
    if len(metadata) >= 8 and struct.unpack_from("<I", metadata)[0] == 1:
        return struct.unpack_from("<I", metadata, 4)[0]
    return None


def _context(delegates: list[QnnDelegate], info: BinaryInfo) -> ContextReport:
    options = delegates[0].options
    soc = Soc.from_soc_model(info.soc_model or -1)
    graphs = []
    for g in info.graphs:
        sizes = _htp_graph_sizes(g.blob)
        graphs.append(GraphReport(g.name, g.inputs, g.outputs, sizes.const, sizes.shared, sizes.spill_fill, sizes.io,
                                  sizes.op_data))
    return ContextReport(
        delegates=[f"{d.method}[{d.index}]" for d in delegates],
        size=len(delegates[0].binary),
        build_id=info.build_id,
        soc=soc.value if soc else (info.soc_version or f"id {info.soc_model}"),
        htp_arch=_htp_arch(info.metadata) or (options.htp_arch if options else None),
        weight_sharing=options.weight_sharing if options else None,
        shared_weights_bytes=max((g.shared_weights_bytes or 0 for g in graphs), default=0),
        const_bytes=sum(g.const_bytes or 0 for g in graphs),
        context_blob_size=info.context_blob_size,
        graphs=graphs,
    )


def _context_infos(data: bytes | mmap.mmap, where: str) -> list[tuple[list[QnnDelegate], BinaryInfo]]:
    """Each QNN context of a serialized program once, with the delegates that run it, read by the QNN System library."""
    by_key: dict[str, list[QnnDelegate]] = {}
    for delegate in qnn_delegates(data, where):
        by_key.setdefault(delegate.key, []).append(delegate)
    if not by_key:
        raise QnnInspectError(f"{where} holds no QNN delegate: nothing was lowered to QNN")
    system = QnnSystem.get()
    return [(ds, system.binary_info(ds[0].binary)) for ds in by_key.values()]


def _mapped(path: Path) -> bytes | mmap.mmap:
    try:
        with path.open("rb") as f:
            # Mapped, not read: a Gemma-4-E2B program is 3 GB, and only its contexts (a third) are looked at.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
    except OSError as e:
        raise QnnInspectError(f"Cannot read {path}: {e.strerror or e}") from None


def inspect_bytes(data: bytes | mmap.mmap, where: str = ".pte") -> PteReport:
    """`inspect_pte` of a serialized program already in memory (the exporter's lowered buffer)."""
    return PteReport(where, len(data), [_context(ds, info) for ds, info in _context_infos(data, where)])


def inspect_pte(path: str | Path) -> PteReport:
    """Read every QNN context binary of a `.pte` with the QNN System library.

    Raises:
        QnnInspectError: a file that is missing, not an ExecuTorch program, holds no QNN delegate, or a context
            binary the QNN System library refuses.
    """
    return inspect_bytes(_mapped(Path(path)), str(path))


def program_load_bytes(path: str | Path) -> int:
    """`graph_load_bytes` summed over every graph of every QNN context of the `.pte` at ``path``: what the x86
    emulator must hold to load it (`program.check_emulator_can_hold`).

    Raises:
        QnnInspectError: as `inspect_pte`.
    """
    data = _mapped(Path(path))
    try:
        infos = _context_infos(data, str(path))
        return sum(graph_load_bytes(g.blob) for _, info in infos for g in info.graphs)
    finally:
        infos = None  # the views into the map go first, so that it can be unmapped here rather than by the collector
        if isinstance(data, mmap.mmap):
            with contextlib.suppress(BufferError):
                data.close()


# --- Plain text ------------------------------------------------------------------------------------------------


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MB"


def _encoding_text(encoding: Encoding | None) -> str:
    return "-" if encoding is None else encoding.summary()


def context_load_bytes(context: ContextReport) -> int:
    """The HTP memory QNN reserves to load ``context``: its shared weight pool once, and per graph what
    `graph_load_bytes` counts. The x86 emulator holds every context of a process in one protection domain
    (`program.check_emulator_can_hold`); a Snapdragon spreads them over several."""
    return context.shared_weights_bytes + sum(
        _load_bytes(g.const_bytes, g.io_bytes, g.spill_fill_bytes, g.op_data_bytes) for g in context.graphs)


def format_report(report: PteReport) -> str:
    total = sum(context_load_bytes(c) for c in report.contexts)
    lines = [f"{report.path}: {_mb(report.size)}, {len(report.contexts)} QNN context(s), HTP load {_mb(total)} (weights, "
             "IO, spill-fill and op data: what QNN reserves to load them)"]
    for i, c in enumerate(report.contexts):
        sharing = {True: "shared between graphs", False: "per graph", None: "unknown"}[c.weight_sharing]
        lines += [
            "",
            f"context {i}: {', '.join(c.delegates)}",
            f"  target    {c.soc}, HTP v{c.htp_arch}" if c.htp_arch else f"  target    {c.soc}",
            f"  QAIRT     {c.build_id}",
            f"  size      {_mb(c.size)} (context blob {_mb(c.context_blob_size)})",
            f"  weights   {sharing}: shared pool {_mb(c.shared_weights_bytes)}, per-graph constants {_mb(c.const_bytes)}",
            f"  HTP load  {_mb(context_load_bytes(c))}",
        ]
        for g in c.graphs:
            lines.append(
                f"  graph {g.name}: {len(g.inputs)} inputs, {len(g.outputs)} outputs, constants {_mb(g.const_bytes)}, "
                f"shared weights {_mb(g.shared_weights_bytes)}, spill-fill {_mb(g.spill_fill_bytes)}, IO "
                f"{_mb(g.io_bytes)}, op data {_mb(g.op_data_bytes)}"
            )
            rows = [("io", "name", "dtype", "shape", "encoding")]
            rows += [("in", t.name, t.dtype, "x".join(map(str, t.shape)), _encoding_text(t.encoding)) for t in g.inputs]
            rows += [("out", t.name, t.dtype, "x".join(map(str, t.shape)), _encoding_text(t.encoding)) for t in g.outputs]
            widths = [max(len(r[k]) for r in rows) for k in range(4)]
            for r in rows:
                lines.append("    " + "  ".join(r[k].ljust(widths[k]) for k in range(4)) + "  " + r[4])
    return "\n".join(lines)


# --- Shared vs non-shared build --------------------------------------------------------------------------------


def _signature(t: TensorInfo) -> tuple:
    return t.dtype, tuple(t.shape), t.encoding


def compare_builds(shared: PteReport, unshared: PteReport) -> SharingCheck:
    """Check that a weight-shared build holds the same graphs, IO and encodings as the non-shared one, and stores
    its weights once.

    Graphs are matched by name; their inputs and outputs in order, each by name, dtype, shape and encoding
    (scale and offset compared exactly: both builds come from the same calibrated graph).
    """
    diffs: list[str] = []
    if len(shared.contexts) != len(unshared.contexts):
        diffs.append(f"{len(shared.contexts)} contexts in the shared build, {len(unshared.contexts)} in the other")
    for ci, (a, b) in enumerate(zip(shared.contexts, unshared.contexts)):
        names_a, names_b = [g.name for g in a.graphs], [g.name for g in b.graphs]
        if sorted(names_a) != sorted(names_b):
            diffs.append(f"context {ci}: graphs {names_a} vs {names_b}")
            continue
        graphs_b = {g.name: g for g in b.graphs}
        for ga in a.graphs:
            gb = graphs_b[ga.name]
            for kind, xs, ys in (("input", ga.inputs, gb.inputs), ("output", ga.outputs, gb.outputs)):
                if len(xs) != len(ys):
                    diffs.append(f"context {ci} graph {ga.name}: {len(xs)} vs {len(ys)} {kind}s")
                    continue
                for x, y in zip(xs, ys):
                    if x.name != y.name or _signature(x) != _signature(y):
                        diffs.append(
                            f"context {ci} graph {ga.name} {kind} {x.name}: {x.dtype} {x.shape} {_encoding_text(x.encoding)}"
                            f" vs {y.name}: {y.dtype} {y.shape} {_encoding_text(y.encoding)}"
                        )
    shared_size = sum(c.size for c in shared.contexts)
    unshared_size = sum(c.size for c in unshared.contexts)
    pool = sum(c.shared_weights_bytes for c in shared.contexts)
    extra_copies = sum(max(len(c.graphs) - 1, 0) for c in shared.contexts)
    saved = unshared_size - shared_size
    once = (
        pool > 0
        and all(c.weight_sharing for c in shared.contexts)
        and not any(c.shared_weights_bytes for c in unshared.contexts)
        and saved >= extra_copies * pool // 2
    )
    return SharingCheck(not diffs, diffs, shared_size, unshared_size, saved, pool, once)


def manifest_inspection(report: PteReport, check: SharingCheck | None = None) -> Inspection:
    """The manifest's `inspection` section: `report`'s contexts, and the shared/non-shared check when one ran."""
    def tensors(ts: list[TensorInfo]) -> list[QnnTensor]:
        return [QnnTensor(t.name, t.dtype, list(t.shape), t.encoding.summary() if t.encoding else None) for t in ts]

    contexts = [
        QnnContext(
            delegates=list(c.delegates), size=c.size, soc=c.soc, htp_arch=c.htp_arch, build_id=c.build_id,
            weight_sharing=c.weight_sharing, shared_weights_bytes=c.shared_weights_bytes, const_bytes=c.const_bytes,
            graphs=[QnnGraph(g.name, tensors(g.inputs), tensors(g.outputs)) for g in c.graphs],
        )
        for c in report.contexts
    ]
    return Inspection(contexts, check)


def export_time_inspection(program: bytes | Path, lower_unshared: Callable[[], bytes] | None = None) -> Inspection | None:
    """The manifest's `inspection` of a freshly lowered program.

    Args:
        program: the lowered `.pte` bytes, or the file they were written to.
        lower_unshared: when given (and the program shares weights), lowers the same graphs without weight sharing
            and returns its bytes; both builds are then compared (`compare_builds`) and the result recorded.
    """
    try:
        report = inspect_pte(program) if isinstance(program, Path) else inspect_bytes(program, "the lowered program")
    except QnnInspectError as e:
        if lower_unshared is not None:
            raise
        # The record is optional: a QNN System library this reader does not understand must not stop an export.
        logger.warning("Not recording the context binaries in the manifest: %s", e)
        return None
    check = None
    if lower_unshared is not None and any(c.weight_sharing for c in report.contexts):
        check = compare_builds(report, inspect_bytes(lower_unshared(), "the non-shared lowering"))
        if check.same_graphs and check.weights_stored_once:
            logger.info(
                "Weight-shared build checked against the non-shared one: same graphs, IO and encodings; "
                "%.2f MB smaller (shared weight pool %.2f MB)", check.saved_bytes / 2**20, check.shared_weights_bytes / 2**20,
            )
        else:
            logger.warning("The weight-shared build differs from the non-shared one: %s", "; ".join(check.differences)
                           or f"weights not stored once (saved {check.saved_bytes} bytes, pool {check.shared_weights_bytes})")
    return manifest_inspection(report, check)
