"""Read each method's execution plan out of an ExecuTorch `.pte`: its values, operators and instruction chain.

`pte.py` finds the QNN delegates; a runtime that runs the program without ExecuTorch (the onnxruntime backend) also
needs everything around them: which tensors the method takes and returns, the constant tables its CPU-side ops read
(embedding tables, their scales), and the order in which kernels and delegates run. All of it is read here with
`struct` from the flatbuffer (`schema/program.fbs` of executorch 1.5.1, field numbers in declaration order; a union
field takes two slots, its type byte then its value), so reading a program imports neither torch nor ExecuTorch.

Constant tensors are views into the program's bytes (a mapped file stays mapped, nothing is copied).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from optimum_qnn.artifacts.inspection.pte import QnnDelegate, _delegates, _Table
from optimum_qnn.artifacts.inspection.qnn_system import QnnInspectError

# Program, ExecutionPlan, Chain, Tensor... field numbers (executorch 1.5.1 schema/program.fbs).
_PROGRAM_EXECUTION_PLAN, _PROGRAM_CONSTANT_BUFFER, _PROGRAM_SEGMENTS, _PROGRAM_CONSTANT_SEGMENT = 1, 2, 4, 5
_PLAN_NAME, _PLAN_VALUES, _PLAN_INPUTS, _PLAN_OUTPUTS, _PLAN_CHAINS, _PLAN_OPERATORS, _PLAN_DELEGATES = 0, 2, 3, 4, 5, 6, 7
_CHAIN_INSTRUCTIONS = 2
_TENSOR_SCALAR_TYPE, _TENSOR_STORAGE_OFFSET, _TENSOR_SIZES, _TENSOR_DIM_ORDER = 0, 1, 2, 3
_TENSOR_DATA_BUFFER_IDX, _TENSOR_ALLOCATION_INFO, _TENSOR_EXTRA_INFO = 5, 6, 9
_SUBSEGMENT_INDEX, _SUBSEGMENT_OFFSETS = 0, 1

# KernelTypes union tags (0 is NONE).
_NULL, _INT, _BOOL, _DOUBLE, _TENSOR, _STRING, _INT_LIST, _DOUBLE_LIST, _BOOL_LIST, _TENSOR_LIST, _OPT_TENSOR_LIST = range(1, 12)
# InstructionArguments union tags.
_KERNEL_CALL, _DELEGATE_CALL, _MOVE_CALL, _JUMP_FALSE_CALL, _FREE_CALL = range(1, 6)

# ExecuTorch ScalarType -> (numpy dtype name, bytes per element). Types the CPU side of our programs never holds
# (quantized ints, float8, bit fields) are left out: a tensor of one of them is refused by name.
SCALAR_TYPES: dict[int, tuple[str, int]] = {
    0: ("uint8", 1), 1: ("int8", 1), 2: ("int16", 2), 3: ("int32", 4), 4: ("int64", 8), 5: ("float16", 2),
    6: ("float32", 4), 7: ("float64", 8), 11: ("bool", 1), 15: ("bfloat16", 2), 27: ("uint16", 2),
    28: ("uint32", 4), 29: ("uint64", 8),
}


@dataclass(frozen=True)
class TensorValue:
    """A tensor of the plan: its type and shape, and its bytes when it is a constant of the program.

    Args:
        dtype: a `SCALAR_TYPES` name, e.g. `float32`.
        sizes: the static shape.
        constant: the constant's bytes (a view into the program), or None for inputs, outputs and intermediates.
        dim_order: the memory order of the dimensions; (0, 1, ...) is contiguous.
    """

    dtype: str
    sizes: tuple[int, ...]
    constant: memoryview | None = None
    dim_order: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        count = 1
        for s in self.sizes:
            count *= s
        return count * next(size for name, size in SCALAR_TYPES.values() if name == self.dtype)


# A value is a TensorValue, a Python scalar/str/None, a tuple of ints/floats/bools, or a TensorList of value indices.
@dataclass(frozen=True)
class TensorList:
    items: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class KernelCall:
    """Run operator `op` (an index into the plan's operators) on the values at `args` (outputs last)."""

    op: int
    args: tuple[int, ...]


@dataclass(frozen=True)
class DelegateCall:
    """Run delegate `delegate` (an index into the plan's delegates) on the values at `args` (inputs, then outputs)."""

    delegate: int
    args: tuple[int, ...]


@dataclass(frozen=True)
class OtherInstruction:
    """A move, jump or free: our programs hold none, so a runtime refuses a plan that has one, by `kind`."""

    kind: str


@dataclass(frozen=True)
class ExecutionPlan:
    """One method of the program.

    Args:
        name: the method name, e.g. `kv_forward`.
        values: every value of the method (`TensorValue`, scalars, lists), indexed by the instructions' args.
        inputs, outputs: indices into `values`, in the method's own order.
        operators: the kernel names, `namespace::name.overload` (e.g. `quantized_decomposed::embedding_byte.out`).
        instructions: the first chain's instructions in execution order.
        delegates: the backend id of each delegate (`QnnBackend`...), by delegate index.
        qnn: the QNN delegates of this method, by delegate index.
    """

    name: str
    values: list
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    operators: tuple[str, ...]
    instructions: tuple[KernelCall | DelegateCall | OtherInstruction, ...]
    delegates: tuple[str, ...]
    qnn: dict[int, QnnDelegate] = field(default_factory=dict)


def read_plans(data: bytes | memoryview, where: str = ".pte") -> dict[str, ExecutionPlan]:
    """Every method of a serialized ExecuTorch program, by name.

    Raises:
        QnnInspectError: bytes that are not an ExecuTorch program, or a corrupt or truncated one.
    """
    if len(data) < 40 or bytes(data[4:6]) != b"ET":
        raise QnnInspectError(f"{where} is not an ExecuTorch program (no ET file identifier)")
    try:
        return _plans(data)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
        raise QnnInspectError(f"{where} is corrupt or truncated ({e}); export it again") from None


def _plans(data: bytes | memoryview) -> dict[str, ExecutionPlan]:
    buf = data  # bytes or a mapped file: _Table reads with struct, which takes either
    program = _Table(buf, struct.unpack_from("<I", buf, 0)[0])
    segment_base = struct.unpack_from("<Q", buf, 24)[0] if bytes(buf[8:12]) == b"eh00" else 0
    segments = [(s.scalar(0, "Q"), s.scalar(1, "Q")) for s in program.tables(_PROGRAM_SEGMENTS)]
    constants = _Constants(buf, program, segments, segment_base)
    qnn: dict[tuple[str, int], QnnDelegate] = {(d.method, d.index): d for d in _delegates(buf)}
    plans = {}
    for plan in program.tables(_PROGRAM_EXECUTION_PLAN):
        name = plan.string(_PLAN_NAME)
        operators = tuple(
            f"{op.string(0)}.{op.string(1)}" if op.string(1) else op.string(0) for op in plan.tables(_PLAN_OPERATORS)
        )
        chains = plan.tables(_PLAN_CHAINS)
        if len(chains) != 1:
            raise ValueError(f"method {name} has {len(chains)} chains; a straight-line program has one")
        delegates = tuple(d.string(0) for d in plan.tables(_PLAN_DELEGATES))
        plans[name] = ExecutionPlan(
            name=name,
            values=[_value(v, constants) for v in plan.tables(_PLAN_VALUES)],
            inputs=tuple(_ints(plan, _PLAN_INPUTS, "i")),
            outputs=tuple(_ints(plan, _PLAN_OUTPUTS, "i")),
            operators=operators,
            instructions=tuple(_instruction(i) for i in chains[0].tables(_CHAIN_INSTRUCTIONS)),
            delegates=delegates,
            qnn={index: d for (method, index), d in qnn.items() if method == name},
        )
    return plans


def _ints(table: _Table, index: int, fmt: str) -> list:
    """A vector of scalars (`fmt`: `i` int32, `q` int64, `B` ubyte, `d` double, `?` bool)."""
    at = table._field(index)
    if at is None:
        return []
    start = table._indirect(at)
    length = struct.unpack_from("<I", table.buf, start)[0]
    return list(struct.unpack_from(f"<{length}{fmt}", table.buf, start + 4))


class _Constants:
    """Where the program keeps its constant tensors: the constant segment (current exports) or, in older
    programs, the `constant_buffer` tables inside the flatbuffer."""

    def __init__(self, buf, program: _Table, segments: list[tuple[int, int]], segment_base: int):
        self.buf = buf
        self.offsets: list[int] = []
        self.base = 0
        self.end = 0
        sub = program.table(_PROGRAM_CONSTANT_SEGMENT)
        if sub is not None:
            self.offsets = _ints(sub, _SUBSEGMENT_OFFSETS, "Q")
            if self.offsets:
                offset, size = segments[sub.scalar(_SUBSEGMENT_INDEX, "I")]
                self.base, self.end = segment_base + offset, segment_base + offset + size
        self.buffers = program.tables(_PROGRAM_CONSTANT_BUFFER)

    def view(self, index: int, nbytes: int) -> memoryview:
        if self.offsets:
            start = self.base + self.offsets[index]
            if start + nbytes > self.end or self.end > len(self.buf):
                raise ValueError(f"constant {index} runs past the end of its segment")
            return memoryview(self.buf)[start:start + nbytes]
        start = self.buffers[index].blob_offset(0)
        if start is None:
            raise ValueError(f"constant buffer {index} is empty")
        return memoryview(self.buf)[start:start + nbytes]


def _value(evalue: _Table, constants: _Constants):
    tag = evalue.scalar(0, "B")
    body = evalue.table(1)
    if tag in (0, _NULL) or body is None:
        return None
    if tag == _INT:
        return body.scalar(0, "q")
    if tag == _BOOL:
        return bool(body.scalar(0, "B"))
    if tag == _DOUBLE:
        return body.scalar(0, "d")
    if tag == _STRING:
        return body.string(0)
    if tag == _INT_LIST:
        return tuple(_ints(body, 0, "q"))
    if tag == _DOUBLE_LIST:
        return tuple(_ints(body, 0, "d"))
    if tag == _BOOL_LIST:
        return tuple(bool(b) for b in _ints(body, 0, "B"))
    if tag in (_TENSOR_LIST, _OPT_TENSOR_LIST):
        return TensorList(tuple(_ints(body, 0, "i")), optional=tag == _OPT_TENSOR_LIST)
    if tag == _TENSOR:
        return _tensor(body, constants)
    raise ValueError(f"unknown value type {tag}")


def _tensor(t: _Table, constants: _Constants) -> TensorValue:
    scalar_type = t.scalar(_TENSOR_SCALAR_TYPE, "b")
    if scalar_type not in SCALAR_TYPES:
        raise ValueError(f"tensor of ExecuTorch scalar type {scalar_type}, which this reader does not know")
    sizes = tuple(_ints(t, _TENSOR_SIZES, "i"))
    dim_order = tuple(_ints(t, _TENSOR_DIM_ORDER, "B"))
    value = TensorValue(SCALAR_TYPES[scalar_type][0], sizes, None, dim_order)
    buffer_index = t.scalar(_TENSOR_DATA_BUFFER_IDX, "I")
    # A constant has a data buffer and no memory-planned location; index 0 is reserved for "no data".
    if buffer_index and t.table(_TENSOR_ALLOCATION_INFO) is None:
        if t.table(_TENSOR_EXTRA_INFO) is not None:
            raise ValueError("a tensor stored outside the program (external data) is not supported")
        if t.scalar(_TENSOR_STORAGE_OFFSET, "i"):
            raise ValueError("a constant with a storage offset is not supported")
        value = TensorValue(value.dtype, sizes, constants.view(buffer_index, value.nbytes), dim_order)
    return value


def _instruction(instruction: _Table) -> KernelCall | DelegateCall | OtherInstruction:
    tag = instruction.scalar(0, "B")
    body = instruction.table(1)
    if tag == _KERNEL_CALL:
        return KernelCall(body.scalar(0, "i"), tuple(_ints(body, 1, "i")))
    if tag == _DELEGATE_CALL:
        return DelegateCall(body.scalar(0, "i"), tuple(_ints(body, 1, "i")))
    kinds = {_MOVE_CALL: "MoveCall", _JUMP_FALSE_CALL: "JumpFalseCall", _FREE_CALL: "FreeCall"}
    return OtherInstruction(kinds.get(tag, f"instruction type {tag}"))
