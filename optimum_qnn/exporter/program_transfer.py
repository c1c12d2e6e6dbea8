"""Hand an edge-dialect `ExportedProgram` from a forked child to its parent, node metadata and all.

A program does not pickle as it is: `GraphModule.__reduce__` regenerates the graph from its Python code (every
node's metadata is lost: the QNN passes' quantization encodings, the fake tensors the partitioner reads shapes
from), `FakeTensor`s are tied to the fake mode that made them, and the op overloads a graph calls are native
objects (measured on torch 2.13 / executorch 1.5.1). This module writes the graph node by node (op, name, target,
arguments, metadata), each fake tensor as its shape, strides and dtype (made again under one fresh fake mode per
program), each op overload as its name, and each weight the child's program still shares with its parent (the
child was forked after they were made, and lowering never writes into a tensor) as a reference to the parent's
tensor, so that gigabytes of weights are neither copied into the file nor duplicated in the parent.

Used by `optimum_qnn.exporter.edge.to_edge`, which converts the methods of a multi-method lowering in parallel: one
in the export's own process, the others in forked children (ExecuTorch's edge passes are Python on one core).
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import torch

_PROTOCOL = pickle.HIGHEST_PROTOCOL


class SharedTensors:
    """The tensors a parent and its forked child both have at the same address: what the child refers to instead
    of writing. Built in the parent before the fork, from every tensor of the programs the child starts from."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.by_storage: dict[int, torch.Tensor] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not _is_fake(t):
                storage = t.untyped_storage()
                if storage.nbytes():
                    self.by_storage.setdefault(storage.data_ptr(), t)

    @staticmethod
    def tensors_of(source: Any) -> list[torch.Tensor]:
        """Every tensor a method's source holds: an exported program's weights and constants, or a module's (of
        ``(module, example_inputs)``) parameters, buffers and plain tensor attributes (a `convert_pt2e` graph's
        constants)."""
        if isinstance(source, torch.export.ExportedProgram):
            return [*source.state_dict.values(), *source.constants.values()]
        tensors = []
        for m in source[0].modules():
            tensors += [t for t in vars(m).get("_parameters", {}).values() if t is not None]
            tensors += [t for t in vars(m).get("_buffers", {}).values() if t is not None]
            tensors += [t for t in vars(m).values() if isinstance(t, torch.Tensor)]
        return tensors


def dump(program: torch.export.ExportedProgram, file: BinaryIO, shared: SharedTensors) -> None:
    """Write `program` to `file` (in the child)."""
    _Pickler(file, shared).dump(_program_state(program))


def load(file: BinaryIO, shared: SharedTensors) -> torch.export.ExportedProgram:
    """The program `dump` wrote (in the parent: `shared` must be the same object the child was forked with)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with _loading(shared, FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())), warnings.catch_warnings():
        # torch 2.13 makes an unpickled LeafSpec through a constructor that warns of its own deprecation.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        state = pickle.load(file)
    return _program_from_state(state)


def op_name(op: Any) -> tuple[str, str, str | None]:
    """An op overload as (namespace, name, overload), what `op_from_name` finds it again by."""
    reduced = _op_reference(op)
    if reduced is None or reduced[0] is not _torch_op:
        raise TypeError(f"Not an ATen or custom op overload: {op!r}")
    return reduced[1]


def op_from_name(name: tuple[str, str, str | None]) -> Any:
    return _torch_op(*name)


# ---- writing ---------------------------------------------------------------------------------------------------


def _program_state(program: torch.export.ExportedProgram) -> dict[str, Any]:
    return {
        "graph_module": program.graph_module,
        "graph_signature": program.graph_signature,
        "state_dict": program.state_dict,
        "range_constraints": program.range_constraints,
        "module_call_graph": program.module_call_graph,
        "example_inputs": program.example_inputs,
        "constants": program.constants,
        "verifiers": program.verifiers,
    }


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class _Pickler(pickle.Pickler):
    def __init__(self, file: BinaryIO, shared: SharedTensors):
        super().__init__(file, protocol=_PROTOCOL)
        self.shared = shared

    def reducer_override(self, obj: Any):  # noqa: C901 - one branch per kind of object a graph holds
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(obj, torch.fx.Node):
            return _NodeRef, (obj.name, id(obj.graph), obj.op, obj.target)
        if isinstance(obj, FakeTensor):
            return _make_fake, (tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(), obj.dtype,
                                str(obj.device), obj.requires_grad)
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            storage = obj.untyped_storage()
            base = self.shared.by_storage.get(storage.data_ptr()) if storage.nbytes() else None
            if base is not None and base.untyped_storage().nbytes() == storage.nbytes():
                return _shared_tensor, (storage.data_ptr(), obj.storage_offset(), tuple(obj.shape),
                                        tuple(obj.stride()), obj.dtype, isinstance(obj, torch.nn.Parameter),
                                        obj.requires_grad)
            return NotImplemented
        if isinstance(obj, torch.SymInt | torch.SymFloat | torch.SymBool):
            raise TypeError(f"A graph with symbolic shapes cannot be handed between processes ({obj})")
        if isinstance(obj, torch.fx.GraphModule):
            return _make_graph_module, _graph_module_state(obj)
        op = _op_reference(obj)
        if op is not None:
            return op
        if isinstance(obj, type) and obj.__qualname__.endswith("._EXIREdgeDialectVerifier"):
            # A class ExecuTorch makes in a function (its closure holds the op lists): made again from what it holds.
            verifier = obj()
            return _edge_verifier, (verifier.enable, verifier.use_dim_order, list(verifier._core_aten_ops_exception_list),
                                    list(verifier._preserve_ops))
        return NotImplemented


def _op_reference(obj: Any):
    """An op overload (ATen, custom or ExecuTorch's edge dialect) as the function that finds it again by name."""
    from executorch.exir.dialects.edge._ops import EdgeOpOverload, EdgeOpOverloadPacket

    if isinstance(obj, EdgeOpOverload):
        return _edge_op, (obj.namespace, obj._op._opname, obj._op._overloadname)
    if isinstance(obj, EdgeOpOverloadPacket):
        return _edge_op, (obj._qualified_op_name.split("::")[0], obj._op._qualified_op_name.split("::")[1], None)
    if isinstance(obj, torch._ops.OpOverload):
        return _torch_op, (obj.namespace, obj._opname, obj._overloadname)
    if isinstance(obj, torch._ops.OpOverloadPacket):
        namespace, name = obj._qualified_op_name.split("::")
        return _torch_op, (namespace, name, None)
    if isinstance(obj, torch._ops.HigherOrderOperator):
        return _higher_order_op, (obj.name(),)
    return None


def _graph_module_state(gm: torch.fx.GraphModule) -> tuple:
    graph = gm.graph
    # A node's users in the order they were added (a partition's outputs follow it), not in graph order.
    nodes = [(n.name, n.op, n.target, n.args, n.kwargs, n.meta, n.type, [u.name for u in n.users]) for n in graph.nodes]
    # What get_attr nodes and call_module nodes reach (submodules, e.g. a lowered delegate, and attribute tensors).
    attributes = {}
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module"):
            attributes[n.target] = _get_dotted(gm, n.target)
    # The names the graph has handed out (removed nodes' included) and the last number of each base name: the names
    # later passes give new nodes depend on them, and QNN names its tensors after the nodes.
    namespace = graph._graph_namespace
    names = (set(namespace._used_names), dict(namespace._base_count))
    return (id(graph), nodes, attributes, graph._codegen, dict(gm.meta), type(gm).__name__, names)


def _get_dotted(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# ---- reading ---------------------------------------------------------------------------------------------------

# (the tensors shared with the child, the fake mode of the program being read, the stand-ins made for it)
_load_context: list[tuple[SharedTensors, Any, dict[tuple[int, str], torch.fx.Node]]] = []


@contextlib.contextmanager
def _loading(shared: SharedTensors, fake_mode) -> Iterator[None]:
    _load_context.append((shared, fake_mode, {}))
    try:
        yield
    finally:
        _load_context.pop()


class _NodeRef:
    """A node named in arguments or metadata, until the graph that holds it is built. Metadata also names nodes of
    graphs that are gone (ExecuTorch's passes keep the node a node was made from in `source_fn_stack`): those come
    back as stand-ins of the same name, op and target in a graph of their own."""

    __slots__ = ("name", "graph", "op", "target")

    def __init__(self, name: str, graph: int, op: str, target: Any):
        self.name, self.graph, self.op, self.target = name, graph, op, target


def _stand_in(ref: _NodeRef) -> torch.fx.Node:
    _, _, made = _load_context[-1]
    key = (ref.graph, ref.name)
    if key not in made:
        made[key] = torch.fx.Graph().create_node(ref.op, ref.target, name=ref.name)
    return made[key]


def _make_fake(shape, stride, offset, dtype, device, requires_grad):
    _, fake_mode, _ = _load_context[-1]
    with fake_mode:
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if offset:
            t = t.as_strided(shape, stride, offset)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _shared_tensor(ptr, offset, shape, stride, dtype, is_parameter, requires_grad):
    shared, _, _ = _load_context[-1]
    base = shared.by_storage.get(ptr)
    if base is None:
        raise RuntimeError("A tensor the child shared with this process is not among the parent's tensors")
    t = torch.empty(0, dtype=dtype).set_(base.untyped_storage(), offset, shape, stride)
    if is_parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t


def _edge_verifier(enable, use_dim_order, exception_list, preserve_ops):
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.verification.verifier import EXIREdgeDialectVerifier

    config = EdgeCompileConfig(_check_ir_validity=enable, _skip_dim_order=not use_dim_order)
    return EXIREdgeDialectVerifier(edge_compile_config=config, class_only=True,
                                   core_aten_ops_exception_list=exception_list, preserve_ops=preserve_ops)


def _torch_op(namespace, name, overload):
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _edge_op(namespace, name, overload):
    from executorch.exir.dialects._ops import ops as exir_ops

    packet = getattr(getattr(exir_ops.edge, namespace), name)
    return packet if overload is None else getattr(packet, overload or "default")


def _higher_order_op(name):
    import torch._higher_order_ops  # noqa: F401 - registers them

    return getattr(torch.ops.higher_order, name)


def _resolve(value: Any, nodes: dict[str, torch.fx.Node], graph: int) -> Any:
    if isinstance(value, _NodeRef):
        return nodes[value.name] if value.graph == graph else _stand_in(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_resolve(v, nodes, graph) for v in value))
    if isinstance(value, list | tuple):  # fx's immutable_list too
        return type(value)(_resolve(v, nodes, graph) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _resolve(v, nodes, graph)) for k, v in value.items())
    if isinstance(value, slice):
        return slice(*(_resolve(v, nodes, graph) for v in (value.start, value.stop, value.step)))
    return value


def _has_ref(value: Any) -> bool:
    if isinstance(value, _NodeRef):
        return True
    if isinstance(value, list | tuple):
        return any(_has_ref(v) for v in value)
    if isinstance(value, dict):
        return any(_has_ref(v) for v in value.values())
    if isinstance(value, slice):
        return any(_has_ref(v) for v in (value.start, value.stop, value.step))
    return False


def _make_graph_module(graph_id, nodes, attributes, codegen, gm_meta, class_name, names):
    graph = torch.fx.Graph()
    graph._codegen = codegen
    made: dict[str, torch.fx.Node] = {}
    for name, op, target, args, kwargs, meta, node_type, _ in nodes:
        node = graph.create_node(op, target, _resolve(args, made, graph_id), _resolve(kwargs, made, graph_id),
                                 name=name, type_expr=node_type)
        if node.name != name:
            raise RuntimeError(f"Node {name!r} was made again as {node.name!r}")
        made[name] = node
        node.meta = {k: _resolve(v, made, graph_id) if _has_ref(v) else v for k, v in meta.items()}
    for name, *_, users in nodes:
        node = made[name]
        if list(node.users) != [made[u] for u in users]:
            node.users = {made[u]: None for u in users}
    used, base_count = names
    graph._graph_namespace._used_names = used
    graph._graph_namespace._base_count = base_count
    gm = torch.fx.GraphModule(attributes, graph, class_name=class_name)
    gm.meta.update(gm_meta)
    return gm


def _program_from_state(state: dict[str, Any]) -> torch.export.ExportedProgram:
    from torch.export import ExportedProgram

    gm = state["graph_module"]
    return ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=state["graph_signature"], state_dict=state["state_dict"],
        range_constraints=state["range_constraints"], module_call_graph=state["module_call_graph"],
        example_inputs=state["example_inputs"], constants=state["constants"], verifiers=state["verifiers"],
    )
