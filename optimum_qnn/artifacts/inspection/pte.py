"""Find the QNN delegates of an ExecuTorch `.pte` and the context binary inside each, without ExecuTorch's exporter.

A `.pte` is a flatbuffer (`schema/program.fbs` of executorch, file identifier `ET12`) followed by data segments.
Each method (`ExecutionPlan`) lists its delegates (`BackendDelegate`: backend id, compile specs, and a reference to
the processed bytes, inline in the flatbuffer or in a segment). The QNN backend's processed bytes are ExecuTorch's
"context custom protocol": a little-endian header (magic `0x5678ABCD`, an 8-byte signature, the 8-byte size of the
context binary), zero padding up to the context binary alignment (256 bytes in executorch 1.5.1,
`PyQnnManagerAdaptor.GetQNNCtxBinAlignment()`; none in older releases), then the QNN context binary.

The flatbuffer is read here with a few lines of `struct` (the field numbers come from executorch 1.5.1's schemas),
because executorch's own deserializer imports `torch.export` and the exporter: running or inspecting an artifact
stays light.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from optimum_qnn.artifacts.inspection.qnn_system import QnnInspectError

# Every HTP context binary records the target it was compiled for, e.g. `soc_type=SM8650;arch=75;...`.
_TARGET_RE = re.compile(rb"soc_type=(\w+);arch=(\d+)")

QNN_BACKEND_ID = "QnnBackend"
QNN_COMPILE_SPEC_KEY = "qnn_compile_spec"
_CONTEXT_MAGIC = 0x5678ABCD
_CONTEXT_HEADER = struct.Struct("<IqQ")  # magic, signature, context binary size
_CONTEXT_ALIGNMENTS = (256, 1)  # where the binary may start: the header rounded up to one of these

# Field numbers (0-based, declaration order) in executorch's program.fbs / qc_compiler_spec.fbs.
_PROGRAM_EXECUTION_PLAN, _PROGRAM_DELEGATE_DATA, _PROGRAM_SEGMENTS = 1, 3, 4
_PLAN_NAME, _PLAN_DELEGATES = 0, 7
_DELEGATE_ID, _DELEGATE_PROCESSED, _DELEGATE_COMPILE_SPECS = 0, 1, 2
_REF_LOCATION, _REF_INDEX = 0, 1
_SEGMENT_LOCATION = 1  # DataLocation.SEGMENT
_OPTIONS_SOC_INFO, _OPTIONS_BACKEND_OPTIONS = 0, 1
_SOC_INFO_MODEL, _SOC_INFO_HTP_INFO = 0, 1
_HTP_INFO_ARCH = 0
_BACKEND_OPTIONS_HTP = 1
_HTP_OPTIONS_MULTI_CONTEXTS, _HTP_OPTIONS_WEIGHT_SHARING = 7, 8


class _Table:
    """A flatbuffer table at `pos` of `buf`: just the accessors this module needs."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        self._vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self._vtable_size = struct.unpack_from("<H", buf, self._vtable)[0]

    def _field(self, index: int) -> int | None:
        slot = 4 + 2 * index
        if slot >= self._vtable_size:
            return None
        offset = struct.unpack_from("<H", self.buf, self._vtable + slot)[0]
        return self.pos + offset if offset else None

    def scalar(self, index: int, fmt: str, default=0):
        at = self._field(index)
        return default if at is None else struct.unpack_from("<" + fmt, self.buf, at)[0]

    def _indirect(self, at: int) -> int:
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def table(self, index: int) -> "_Table | None":
        at = self._field(index)
        return None if at is None else _Table(self.buf, self._indirect(at))

    def string(self, index: int) -> str:
        data = self.blob(index)
        return data.decode() if data is not None else ""

    def blob(self, index: int) -> bytes | None:
        at = self.blob_offset(index)
        if at is None:
            return None
        length = struct.unpack_from("<I", self.buf, at - 4)[0]
        return self.buf[at:at + length]

    def blob_offset(self, index: int) -> int | None:
        """Where a byte vector's bytes start in the buffer."""
        at = self._field(index)
        return None if at is None else self._indirect(at) + 4

    def tables(self, index: int) -> list["_Table"]:
        at = self._field(index)
        if at is None:
            return []
        start = self._indirect(at)
        length = struct.unpack_from("<I", self.buf, start)[0]
        return [_Table(self.buf, self._indirect(start + 4 + 4 * i)) for i in range(length)]


@dataclass(frozen=True)
class CompileOptions:
    """What a QNN delegate was compiled for, from its `qnn_compile_spec` (executorch's QnnExecuTorchOptions)."""

    soc_model: int  # executorch's QcomChipset value, e.g. 57 for SM8650
    htp_arch: int  # e.g. 75
    weight_sharing: bool
    multiple_contexts: bool


@dataclass(frozen=True)
class QnnDelegate:
    """One QNN delegate of one method: the context binary it runs and how it was compiled.

    Args:
        method: the method (execution plan) name, e.g. `prefill_forward`.
        index: the delegate's position among the method's delegates (the shard, for sharded exports).
        key: where its bytes live (`segment:3` or `inline:0`): methods whose graphs share a context point at
            the same bytes.
        binary: the QNN context binary (the protocol header stripped); a view into the program's bytes for a
            segment, so reading a program does not copy its contexts.
        options: its compile options, or None when the spec is missing.
        offset: where its processed bytes (the context header, then the binary) start in the program's bytes.
    """

    method: str
    index: int
    key: str
    binary: bytes | memoryview
    options: CompileOptions | None
    offset: int = -1

    @property
    def targets(self) -> frozenset[tuple[str, int]]:
        """The (SoC, HTP arch) records the context binary holds, e.g. {("SM8650", 75)}."""
        return frozenset((soc.decode(), int(arch)) for soc, arch in _TARGET_RE.findall(self.binary))


def strip_context_header(payload: bytes | memoryview) -> bytes | memoryview:
    """The QNN context binary inside a QNN delegate's processed bytes.

    Raises:
        QnnInspectError: a payload that is not ExecuTorch's context protocol (e.g. an online-prepare QCIR payload).
    """
    if len(payload) < _CONTEXT_HEADER.size:
        raise QnnInspectError(f"QNN delegate payload of {len(payload)} bytes is too short for a context header")
    magic, _signature, size = _CONTEXT_HEADER.unpack_from(payload)
    if magic != _CONTEXT_MAGIC:
        raise QnnInspectError(
            f"QNN delegate payload starts with 0x{magic:08x}, not the context binary magic 0x{_CONTEXT_MAGIC:08x} "
            "(a QCIR/online-prepare payload holds no compiled context)"
        )
    for alignment in _CONTEXT_ALIGNMENTS:
        start = -(-_CONTEXT_HEADER.size // alignment) * alignment
        if start + size <= len(payload) and not bytes(payload[_CONTEXT_HEADER.size:start]).strip(b"\0"):
            return payload[start:start + size]
    raise QnnInspectError(f"QNN delegate payload says {size} bytes of context binary but holds {len(payload)}")


def compile_options(spec: bytes) -> CompileOptions:
    """Decode the fields of executorch's `qnn_compile_spec` flatbuffer that say what a context was built for."""
    root = _Table(spec, struct.unpack_from("<I", spec, 0)[0])
    soc = root.table(_OPTIONS_SOC_INFO)
    htp_info = soc.table(_SOC_INFO_HTP_INFO) if soc else None
    backend = root.table(_OPTIONS_BACKEND_OPTIONS)
    htp = backend.table(_BACKEND_OPTIONS_HTP) if backend else None
    return CompileOptions(
        soc_model=soc.scalar(_SOC_INFO_MODEL, "i") if soc else 0,
        htp_arch=htp_info.scalar(_HTP_INFO_ARCH, "i") if htp_info else 0,
        weight_sharing=bool(htp.scalar(_HTP_OPTIONS_WEIGHT_SHARING, "B")) if htp else False,
        multiple_contexts=bool(htp.scalar(_HTP_OPTIONS_MULTI_CONTEXTS, "B")) if htp else False,
    )


def qnn_delegates(data: bytes, where: str = ".pte") -> list[QnnDelegate]:
    """Every QNN delegate of a serialized ExecuTorch program, in method then delegate order.

    Raises:
        QnnInspectError: bytes that are not an ExecuTorch program, or a QNN payload that is not a context binary.
    """
    if len(data) < 40 or data[4:6] != b"ET":
        raise QnnInspectError(f"{where} is not an ExecuTorch program (no ET file identifier)")
    try:
        return _delegates(data)
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise QnnInspectError(f"{where} is corrupt or truncated ({e}); export it again") from None


def _delegates(data: bytes) -> list[QnnDelegate]:
    program = _Table(data, struct.unpack_from("<I", data, 0)[0])
    segment_base = struct.unpack_from("<Q", data, 24)[0] if data[8:12] == b"eh00" else 0
    segments = [(s.scalar(0, "Q"), s.scalar(1, "Q")) for s in program.tables(_PROGRAM_SEGMENTS)]
    inline = program.tables(_PROGRAM_DELEGATE_DATA)
    found = []
    for plan in program.tables(_PROGRAM_EXECUTION_PLAN):
        method = plan.string(_PLAN_NAME)
        for index, delegate in enumerate(plan.tables(_PLAN_DELEGATES)):
            if delegate.string(_DELEGATE_ID) != QNN_BACKEND_ID:
                continue
            ref = delegate.table(_DELEGATE_PROCESSED)
            location, ref_index = ref.scalar(_REF_LOCATION, "b"), ref.scalar(_REF_INDEX, "I")
            if location == _SEGMENT_LOCATION:
                offset, size = segments[ref_index]
                start = segment_base + offset
                if start + size > len(data):
                    raise QnnInspectError(f"segment {ref_index} of method {method} runs past the end of the file")
                # A view, not a copy: the program may be a mapped file of several GB.
                payload, key = memoryview(data)[start:start + size], f"segment:{ref_index}"
            else:
                payload, key = inline[ref_index].blob(0) or b"", f"inline:{ref_index}"
                start = inline[ref_index].blob_offset(0) or -1
            options = None
            for spec in delegate.tables(_DELEGATE_COMPILE_SPECS):
                if spec.string(0) == QNN_COMPILE_SPEC_KEY:
                    options = compile_options(spec.blob(1) or b"")
            found.append(QnnDelegate(method, index, key, strip_context_header(payload), options, start))
    return found


def normalized_program(data: bytes) -> bytes:
    """The program's bytes with the signature of each QNN context header zeroed.

    ExecuTorch stamps each context header with a signature taken from the clock when the context is compiled
    (executorch 1.5.1's QnnContextCustomProtocol), so two lowerings of the same graphs never have the same bytes
    there; everything else of two lowerings from the same QNN state is the same (`optimum_qnn.exporter.forked`).
    Two programs with equal normalized bytes differ in nothing but when they were compiled.

    Raises:
        QnnInspectError: as `qnn_delegates`.
    """
    out = bytearray(data)
    for delegate in qnn_delegates(data):
        signature = delegate.offset + 4  # after the magic
        out[signature:signature + 8] = bytes(8)
    return bytes(out)
