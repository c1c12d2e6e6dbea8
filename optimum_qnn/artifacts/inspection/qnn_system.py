"""Read a QNN context binary's metadata with the QNN System library (`libQnnSystem.so` / `QnnSystem.dll`).

`QnnSystemContext_getBinaryInfo` parses a context binary without a backend: no HTP, no emulator, no device. The
ctypes structures below are written from the public QNN API headers (`QnnTypes.h`, `System/QnnSystemContext.h`,
`System/QnnSystemInterface.h`, QNN API 2.x); only the fields read here are spelled out where a layout allows it,
and every union is sized by its largest member so arrays stride correctly.

Load order matters in a process that also imports torch: `read_binary_info` imports torch before the library is
loaded (ENVIRONMENT.md: a QNN library loaded before torch crashes the process).
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, Union, c_char_p, c_float, c_int32, c_uint8, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass, field
from pathlib import Path

from optimum_qnn.errors import OptimumQnnError


class QnnInspectError(OptimumQnnError):
    """A context binary or a .pte that cannot be read; the message says which and why."""


# --- QnnTypes.h ---------------------------------------------------------------------------------------------------


class _Version(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32), ("patch", c_uint32)]


class _ScaleOffset(Structure):
    _fields_ = [("scale", c_float), ("offset", c_int32)]


class _AxisScaleOffset(Structure):
    _fields_ = [("axis", c_int32), ("numScaleOffsets", c_uint32), ("scaleOffset", POINTER(_ScaleOffset))]


class _BwScaleOffset(Structure):
    _fields_ = [("bitwidth", c_uint32), ("scale", c_float), ("offset", c_int32)]


class _BwAxisScaleOffset(Structure):
    _fields_ = [
        ("bitwidth", c_uint32), ("axis", c_int32), ("numElements", c_uint32),
        ("scales", POINTER(c_float)), ("offsets", POINTER(c_int32)),
    ]


class _BlockEncoding(Structure):
    _fields_ = [("blockSize", POINTER(c_uint32)), ("scaleOffset", POINTER(_ScaleOffset))]


class _BwFloatBlock(Structure):  # the largest-but-one member; kept so the union has the header's size
    _fields_ = [("bitwidth", c_uint32), ("blockSize", POINTER(c_uint32)), ("floatScaleOffset", c_void_p)]


class _Encodings(Union):
    _fields_ = [
        ("scaleOffset", _ScaleOffset),
        ("axisScaleOffset", _AxisScaleOffset),
        ("bwScaleOffset", _BwScaleOffset),
        ("bwAxisScaleOffset", _BwAxisScaleOffset),
        ("block", _BlockEncoding),
        ("pointer", c_void_p),  # blockwise expansion, vector, and the *Mapped encodings are pointers
        ("bwFloatBlock", _BwFloatBlock),
    ]


class _QuantizeParams(Structure):
    _fields_ = [("encodingDefinition", c_uint32), ("quantizationEncoding", c_uint32), ("u", _Encodings)]


class _ClientBuffer(Structure):
    _fields_ = [("data", c_void_p), ("dataSize", c_uint32)]


class _TensorData(Union):
    _fields_ = [("clientBuf", _ClientBuffer), ("memHandle", c_void_p), ("retrieveRaw", c_void_p)]


class _SparseParams(Structure):
    _fields_ = [("type", c_uint32), ("numSpecifiedElements", c_uint32), ("numSparseDimensions", c_uint32)]


class _TensorV2(Structure):
    """`Qnn_TensorV2_t`; `Qnn_TensorV1_t` is its prefix up to `data`, so both are read through it."""

    _fields_ = [
        ("id", c_uint32), ("name", c_char_p), ("type", c_uint32), ("dataFormat", c_uint32), ("dataType", c_uint32),
        ("quantizeParams", _QuantizeParams), ("rank", c_uint32), ("dimensions", POINTER(c_uint32)),
        ("memType", c_uint32), ("data", _TensorData), ("isDynamicDimensions", POINTER(c_uint8)),
        ("sparseParams", _SparseParams), ("isProduced", c_uint8),
    ]


class _Tensor(Structure):
    _fields_ = [("version", c_uint32), ("v", _TensorV2)]


# --- System/QnnSystemContext.h ---------------------------------------------------------------------------------


class _GraphInfoV3(Structure):
    """`QnnSystemContext_GraphInfoV3_t`; V1 and V2 are its prefixes."""

    _fields_ = [
        ("graphName", c_char_p), ("numGraphInputs", c_uint32), ("graphInputs", POINTER(_Tensor)),
        ("numGraphOutputs", c_uint32), ("graphOutputs", POINTER(_Tensor)),
        ("numUpdateableTensors", c_uint32), ("updateableTensors", POINTER(_Tensor)),
        ("graphBlobInfoSize", c_uint32), ("graphBlobInfo", c_void_p), ("startOpIndex", c_uint32),
        ("endOpIndex", c_uint32),
    ]


class _GraphInfo(Structure):
    _fields_ = [("version", c_uint32), ("v", _GraphInfoV3)]


class _BinaryInfoV1(Structure):
    _fields_ = [
        ("backendId", c_uint32), ("buildId", c_char_p), ("coreApiVersion", _Version),
        ("backendApiVersion", _Version), ("socVersion", c_char_p), ("hwInfoBlobVersion", _Version),
        ("contextBlobVersion", _Version), ("hwInfoBlobSize", c_uint32), ("hwInfoBlob", c_void_p),
        ("contextBlobSize", c_uint64), ("numContextTensors", c_uint32), ("contextTensors", POINTER(_Tensor)),
        ("numGraphs", c_uint32), ("graphs", POINTER(_GraphInfo)),
    ]


class _BinaryInfoV2(Structure):
    _fields_ = [*_BinaryInfoV1._fields_, ("platformInfo", c_void_p)]


class _BinaryInfoV3(Structure):
    _fields_ = [
        ("backendId", c_uint32), ("buildId", c_char_p), ("coreApiVersion", _Version),
        ("backendApiVersion", _Version), ("socVersion", c_char_p), ("contextBlobVersion", _Version),
        ("contextBlobSize", c_uint64), ("numContextTensors", c_uint32), ("contextTensors", POINTER(_Tensor)),
        ("numGraphs", c_uint32), ("graphs", POINTER(_GraphInfo)), ("platformInfo", c_void_p),
        ("contextMetadataSize", c_uint32), ("contextMetadata", c_void_p), ("socModel", c_uint32),
    ]


class _BinaryInfoVersions(Union):
    _fields_ = [("v1", _BinaryInfoV1), ("v2", _BinaryInfoV2), ("v3", _BinaryInfoV3)]


class _BinaryInfo(Structure):
    _fields_ = [("version", c_uint32), ("v", _BinaryInfoVersions)]


# --- System/QnnSystemInterface.h: the first four entries of the function table ----------------------------------

_CreateFn = ctypes.CFUNCTYPE(c_uint64, POINTER(c_void_p))
_GetBinaryInfoFn = ctypes.CFUNCTYPE(
    c_uint64, c_void_p, c_void_p, c_uint64, POINTER(POINTER(_BinaryInfo)), POINTER(c_uint64)
)
_FreeFn = ctypes.CFUNCTYPE(c_uint64, c_void_p)


class _SystemFunctions(Structure):
    _fields_ = [
        ("systemContextCreate", _CreateFn),
        ("systemContextGetBinaryInfo", _GetBinaryInfoFn),
        ("systemContextGetMetaData", c_void_p),
        ("systemContextFree", _FreeFn),
    ]


class _SystemInterface(Structure):
    _fields_ = [
        ("backendId", c_uint32), ("providerName", c_char_p), ("systemApiVersion", _Version),
        ("functions", _SystemFunctions),
    ]


# --- What is read ----------------------------------------------------------------------------------------------

# Qnn_DataType_t codes -> short names.
DTYPES = {
    0x0008: "int8", 0x0016: "int16", 0x0032: "int32", 0x0064: "int64",
    0x0108: "uint8", 0x0116: "uint16", 0x0132: "uint32", 0x0164: "uint64",
    0x0216: "float16", 0x0226: "bfloat16", 0x0232: "float32", 0x0264: "float64",
    0x0304: "sfixed4", 0x0308: "sfixed8", 0x0316: "sfixed16", 0x0332: "sfixed32",
    0x0404: "ufixed4", 0x0408: "ufixed8", 0x0416: "ufixed16", 0x0432: "ufixed32",
    0x0508: "bool8", 0x0608: "string",
}
# Qnn_QuantizationEncoding_t codes -> names (UNDEFINED = 0x7FFFFFFF: not quantized).
ENCODINGS = {
    0: "scale_offset", 1: "axis_scale_offset", 2: "bw_scale_offset", 3: "bw_axis_scale_offset", 4: "block",
    5: "blockwise_expansion", 6: "vector", 7: "float_block", 8: "bw_axis_scale_offset_mapped",
    9: "bw_block_mapped", 10: "bw_blockwise_expansion_mapped", 11: "bw_float_block",
}
_UNDEFINED = 0x7FFFFFFF
_DEFINED = 1  # QNN_DEFINITION_DEFINED


@dataclass(frozen=True)
class Encoding:
    """A tensor's quantization encoding; per-channel and block encodings are summarised, not listed.

    Args:
        kind: an `ENCODINGS` name, e.g. `scale_offset`.
        bitwidth: for the bw_* encodings, else None.
        scale, offset: the per-tensor pair; for per-channel/block encodings the first channel's/block's.
        axis: the channel axis of per-channel encodings, else None.
        count: number of scale/offset pairs (1 for per-tensor).
        scale_min, scale_max: the range of the scales (equal to `scale` for per-tensor).
    """

    kind: str
    scale: float | None = None
    offset: int | None = None
    bitwidth: int | None = None
    axis: int | None = None
    count: int = 1
    scale_min: float | None = None
    scale_max: float | None = None

    def summary(self) -> str:
        bw = f"{self.bitwidth}-bit " if self.bitwidth else ""
        if self.count == 1 and self.scale is not None:
            return f"{bw}scale={self.scale:.6g} offset={self.offset}"
        axis = f" axis {self.axis}" if self.axis is not None else ""
        return f"{bw}{self.kind} x{self.count}{axis}, scales {self.scale_min:.3g}..{self.scale_max:.3g}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    encoding: Encoding | None = None


@dataclass(frozen=True)
class GraphInfo:
    """A graph of a context: its IO, and the backend's own description of it (`blob`, opaque here)."""

    name: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    blob: bytes = b""


@dataclass(frozen=True)
class BinaryInfo:
    """What a context binary says about itself.

    Args:
        build_id: the QAIRT build that compiled it, e.g. `v2.49.40.260810104044`.
        soc_version: the target the backend recorded, e.g. `soc_type=SM8650;arch=75` (HTP's wording).
        soc_model: the QNN SoC model id (binary info v3), or None.
        core_api, backend_api: QNN API versions, `major.minor.patch`.
        context_blob_size: bytes of the backend's opaque context blob (the compiled graphs and their weights).
        graphs: the graphs, with their IO.
    """

    info_version: int
    build_id: str
    soc_version: str
    soc_model: int | None
    core_api: str
    backend_api: str
    context_blob_size: int
    context_tensors: int
    graphs: list[GraphInfo] = field(default_factory=list)
    metadata: bytes = b""  # the backend's context metadata (binary info v3), opaque here


def _encoding(params: _QuantizeParams) -> Encoding | None:
    kind_code = params.quantizationEncoding
    if params.encodingDefinition != _DEFINED or kind_code == _UNDEFINED:
        return None
    kind = ENCODINGS.get(kind_code, f"encoding_{kind_code}")
    u = params.u
    if kind_code == 0:
        so = u.scaleOffset
        return Encoding(kind, so.scale, so.offset, scale_min=so.scale, scale_max=so.scale)
    if kind_code == 2:
        so = u.bwScaleOffset
        return Encoding(kind, so.scale, so.offset, bitwidth=so.bitwidth, scale_min=so.scale, scale_max=so.scale)
    if kind_code == 1:
        axis = u.axisScaleOffset
        pairs = [axis.scaleOffset[i] for i in range(axis.numScaleOffsets)]
        return _per_channel(kind, [p.scale for p in pairs], [p.offset for p in pairs], None, axis.axis)
    if kind_code == 3:
        bw = u.bwAxisScaleOffset
        scales = [bw.scales[i] for i in range(bw.numElements)]
        offsets = [bw.offsets[i] for i in range(bw.numElements)] if bw.offsets else [0] * bw.numElements
        return _per_channel(kind, scales, offsets, bw.bitwidth, bw.axis)
    return Encoding(kind, count=0)  # block/expansion/vector encodings: named, not decoded


def _per_channel(kind: str, scales: list[float], offsets: list[int], bitwidth: int | None, axis: int) -> Encoding:
    if not scales:
        return Encoding(kind, bitwidth=bitwidth, axis=axis, count=0)
    return Encoding(
        kind, scales[0], offsets[0], bitwidth=bitwidth, axis=axis, count=len(scales), scale_min=min(scales),
        scale_max=max(scales),
    )


def _tensor(t: _Tensor) -> TensorInfo:
    v = t.v
    shape = [int(v.dimensions[i]) for i in range(v.rank)] if v.dimensions else []
    dtype = DTYPES.get(v.dataType, f"0x{v.dataType:04x}")
    return TensorInfo((v.name or b"").decode(), dtype, shape, _encoding(v.quantizeParams))


def _graphs(count: int, graphs) -> list[GraphInfo]:
    out = []
    for i in range(count):
        g = graphs[i]
        if g.version not in (1, 2, 3):
            raise QnnInspectError(f"Unknown QnnSystemContext_GraphInfo version {g.version}")
        v = g.v
        blob = ctypes.string_at(v.graphBlobInfo, v.graphBlobInfoSize) if g.version == 3 and v.graphBlobInfo else b""
        out.append(GraphInfo(
            (v.graphName or b"").decode(),
            [_tensor(v.graphInputs[j]) for j in range(v.numGraphInputs)],
            [_tensor(v.graphOutputs[j]) for j in range(v.numGraphOutputs)],
            blob,
        ))
    return out


def _version(v: _Version) -> str:
    return f"{v.major}.{v.minor}.{v.patch}"


class QnnSystem:
    """The QNN System library of this process, loaded once (after torch) through `ensure_qnn_sdk()`."""

    _instance: "QnnSystem | None" = None

    def __init__(self, library: Path, *, import_torch: bool = True):
        """Load `library`. `import_torch=False` is for callers that made loading a QNN library before torch safe
        themselves (`optimum_qnn.sdk.onnxruntime_ep.protect_unwinder`) and must stay torch-free."""
        if import_torch:
            import torch  # noqa: F401  (a QNN library loaded before torch crashes the process)

        lib = ctypes.CDLL(str(library))
        get_providers = lib.QnnSystemInterface_getProviders
        get_providers.restype = c_uint64
        get_providers.argtypes = [POINTER(POINTER(POINTER(_SystemInterface))), POINTER(c_uint32)]
        providers = POINTER(POINTER(_SystemInterface))()
        count = c_uint32()
        if get_providers(ctypes.byref(providers), ctypes.byref(count)) != 0 or count.value == 0:
            raise QnnInspectError(f"{library} offers no QNN System interface")
        interface = providers[0].contents
        if interface.systemApiVersion.major != 1:
            raise QnnInspectError(
                f"{library} implements QNN System API {_version(interface.systemApiVersion)}; this reader knows 1.x"
            )
        self.library = library
        self._lib = lib  # keeps the library (and the function table it owns) loaded
        self._functions = interface.functions

    @classmethod
    def get(cls) -> "QnnSystem":
        if cls._instance is None:
            from optimum_qnn.sdk import ensure_qnn_sdk

            sdk = ensure_qnn_sdk()
            system = "QnnSystem.dll" if sdk.htp_library.suffix == ".dll" else "libQnnSystem.so"
            cls._instance = cls(sdk.lib_dir / system)
        return cls._instance

    def binary_info(self, binary: bytes | memoryview) -> BinaryInfo:
        """Parse one context binary (the bytes QNN's `contextGetBinary` wrote)."""
        fns = self._functions
        handle = c_void_p()
        if fns.systemContextCreate(ctypes.byref(handle)) != 0:
            raise QnnInspectError("QnnSystemContext_create failed")
        buffer = (ctypes.c_char * len(binary)).from_buffer_copy(binary)
        info_ptr = POINTER(_BinaryInfo)()
        size = c_uint64()
        try:
            status = fns.systemContextGetBinaryInfo(
                handle, ctypes.cast(buffer, c_void_p), len(binary), ctypes.byref(info_ptr), ctypes.byref(size)
            )
            if status != 0 or not info_ptr:
                raise QnnInspectError(f"QnnSystemContext_getBinaryInfo failed (error {status}): not a QNN context binary")
            return self._read(info_ptr.contents)
        finally:
            fns.systemContextFree(handle)  # frees the info too: everything is copied out above

    @staticmethod
    def _read(info: _BinaryInfo) -> BinaryInfo:
        metadata = b""
        if info.version in (1, 2):
            v = info.v.v1 if info.version == 1 else info.v.v2
            soc_model = None
        elif info.version == 3:
            v = info.v.v3
            soc_model = int(v.socModel)
            if v.contextMetadata:
                metadata = ctypes.string_at(v.contextMetadata, v.contextMetadataSize)
        else:
            raise QnnInspectError(f"Unknown QnnSystemContext_BinaryInfo version {info.version}")
        return BinaryInfo(
            info_version=int(info.version),
            build_id=(v.buildId or b"").decode(),
            soc_version=(v.socVersion or b"").decode(),
            soc_model=soc_model,
            core_api=_version(v.coreApiVersion),
            backend_api=_version(v.backendApiVersion),
            context_blob_size=int(v.contextBlobSize),
            context_tensors=int(v.numContextTensors),
            graphs=_graphs(v.numGraphs, v.graphs),
            metadata=metadata,
        )
