"""Folding the weights' quantization into integer constants, in bounded memory, and sharing them between graphs.

`quantization.convert` calls `fold_weight_quantization` on each converted graph (one memo for all graphs of a
module); `quantization.quantize_shared` then shares equal constants between them. Split from quantization.py.
"""

from __future__ import annotations

import gc
import operator
from collections.abc import Mapping

import torch
from torch import nn

from optimum_qnn.quantization.weights import anonymous_tensors, release_pages, return_free_heap, try_map_to_file

# Dtype casts a weight may pass through between its get_attr and its quantize op (bf16 weights kept in the checkpoint's
# pages are cast to the activation dtype in the graph).
_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout)


def fold_weight_quantization(graph: torch.fx.GraphModule, memo: dict | None = None) -> None:
    """Replace each quantize op on a constant (a weight) by its quantized result, as `convert_pt2e(fold_quantize=True)`
    does, without its peak memory.

    torchao's fold runs a `ConstantFolder` over the whole graph and keeps every constant it computes until the end,
    the dequantized float weights included: one fp32 copy of every weight (6.5 GB at Gemma-4-E2B widths with 2
    layers, 9 GB for the full model). This folder does not evaluate dequantize ops (their results are never folded
    anyway), so only the quantized weights are kept.

    ``memo``: quantized weights by (weight tensor, quantize op, its parameters). The prefill and decode graphs of
    one module read the same weight tensors with the same (copied) observer encodings: with one memo for both,
    the second graph gets the first's integer tensors instead of quantizing every weight again (half the fold time,
    and no second integer copy of the decoder before `share_equal_constants`). Those are replaced before the fold
    runs, so the second graph does not even read (cast) the weights again.

    A weight kept in its stored dtype (bf16, in the checkpoint's mapped pages: `weights.UpcastLinear`) has its pages
    handed back as soon as it is quantized (`weights.release_pages`): Gemma-4-E2B's 4.4 GB of bf16 matrices do not
    stay resident beside their integer copies.
    """
    from torchao.quantization.pt2e.constant_fold import ConstantFolder, replace_node_with_constant
    from torchao.quantization.pt2e.quantize_pt2e import _quant_node_constraint

    if memo:
        _replace_memo_hits(graph, memo)

    class QuantizeFolder(ConstantFolder):  # one class per call: `deferred` is this fold's own
        # cast nodes of a stored-dtype weight read by quantize ops only: their env value is the weight itself, uncast
        deferred: set[torch.fx.Node] = set()

        def _deduce_value(self, node: torch.fx.Node):
            if node.op == "call_function" and _is_dequantize(node.target):
                return self.unknown_value
            if _is_deferrable_cast(graph, node):
                self.deferred.add(node)
                return self.env[node.args[0]]
            if not _quant_node_constraint(node):
                return super()._deduce_value(node)
            key = _fold_key(graph, node, self.env) if memo is not None else None
            if key is not None and key in memo:
                return memo[key]
            if node.args and node.args[0] in self.deferred:
                value = _quantize_stored(node, *self.fetch_args_kwargs_from_env(node))
            else:
                value = super()._deduce_value(node)
            if key is not None:
                memo[key] = value
            source = _fold_source(graph, node)
            if source is not None and source.dtype != torch.float32 and isinstance(value, torch.Tensor):
                release_pages(source)
            return value

    with torch.utils._python_dispatch._disable_current_modes():
        folder = QuantizeFolder(graph, skip_constructors=True)
        folder.run()
        for node, constant in folder.node_replacements.items():
            if _quant_node_constraint(node):
                replace_node_with_constant(graph, node, constant)
        folder = None
    for node in list(graph.graph.find_nodes(op="get_attr")):
        if not node.users:
            if hasattr(graph, node.target):
                delattr(graph, node.target)
            graph.graph.erase_node(node)
    graph.graph.eliminate_dead_code()
    graph.graph.lint()
    graph.recompile()


def _is_dequantize(target) -> bool:
    """A dequantize op, by its overload or its packet: convert_pt2e writes the block-wise weights' dequantize as the
    packet `torch.ops.torchao.dequantize_affine` (no `.default`), per-tensor and per-channel ones as overloads."""
    packet = getattr(target, "overloadpacket", target)
    return packet in (
        torch.ops.quantized_decomposed.dequantize_per_tensor,
        torch.ops.quantized_decomposed.dequantize_per_channel,
        torch.ops.torchao.dequantize_affine,
    )


def _is_deferrable_cast(graph: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A cast to fp32 of a weight kept in its stored dtype (`weights.UpcastLinear`) whose every reader is a quantize
    op: its fp32 copy need not exist, the quantize op casts the weight as it reads it (`_quantize_stored`)."""
    from torchao.quantization.pt2e.quantize_pt2e import _quant_node_constraint

    if not (node.op == "call_function" and node.target in _CASTS and node.users):
        return False
    source = node.args[0]
    if not (isinstance(source, torch.fx.Node) and source.op == "get_attr"):
        return False
    weight = getattr(*_owner(graph, source.target))
    to = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
    return (isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16) and to == torch.float32
            and all(_quant_node_constraint(user) and user.args[0] is node for user in node.users))


def _quantize_stored(node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.Tensor:
    """Evaluate quantize op ``node`` on a weight still in its stored dtype (``args[0]``) as if it had been cast to fp32
    first (the cast is exact): within `kernels.chunked_weight_quantization` (as `pt2e.convert` folds), the per-channel
    and block-wise kernels cast each chunk of rows as they read it; any other op gets the whole cast."""
    from optimum_qnn.quantization.kernels import casts_chunks

    if casts_chunks(node.target):
        return node.target(*args, **kwargs)
    return node.target(args[0].to(torch.float32), *args[1:], **kwargs)


def _replace_memo_hits(graph: torch.fx.GraphModule, memo: Mapping) -> None:
    """Replace the quantize ops whose result `memo` holds by that constant, and drop the casts and weights only they
    read, before the folder would evaluate them."""
    from torchao.quantization.pt2e.constant_fold import replace_node_with_constant
    from torchao.quantization.pt2e.quantize_pt2e import _quant_node_constraint

    for node in list(graph.graph.nodes):
        if not _quant_node_constraint(node):
            continue
        attrs = {arg: getattr(*_owner(graph, arg.target)) for arg in [*node.args[1:], *node.kwargs.values()]
                 if isinstance(arg, torch.fx.Node) and arg.op == "get_attr"}
        key = _fold_key(graph, node, attrs)
        if key is not None and key in memo:
            replace_node_with_constant(graph, node, memo[key])
    graph.graph.eliminate_dead_code()


def weight_attr_node(value: object) -> torch.fx.Node | None:
    """The get_attr node a graph value reads through dtype casts (a weight, possibly kept in its stored dtype), or
    None if it reads no constant."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target in _CASTS:
        value = value.args[0]
    return value if isinstance(value, torch.fx.Node) and value.op == "get_attr" else None


def _fold_source(graph: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor | None:
    """The weight a quantize op reads (through casts), or None if it reads no weight."""
    source = weight_attr_node(node.args[0])
    return None if source is None else getattr(*_owner(graph, source.target))


def _fold_key(graph: torch.fx.GraphModule, node: torch.fx.Node, env: Mapping) -> tuple | None:
    """What makes a quantize op on a weight the same in two graphs: the weight tensor it reads (through casts), the
    op, and its other arguments by value (scales and zero points are small tensors). None if it reads no weight."""
    weight = _fold_source(graph, node)
    if weight is None:
        return None
    parts: list = [node.target, weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape)]
    for arg in [*node.args[1:], *sorted(node.kwargs.items())]:
        value = env.get(arg, arg) if isinstance(arg, torch.fx.Node) else arg
        if isinstance(value, torch.Tensor):
            value = (str(value.dtype), tuple(value.shape), value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, list):
            value = tuple(value)
        parts.append(value)
    return tuple(parts)


def _drop_unused_tensors(graph: torch.fx.GraphModule) -> None:
    """Delete the parameters and buffers no node reads any more (convert_pt2e leaves the float weights it folded
    into quantized constants as attributes, which keeps every fp32 weight alive through lowering)."""
    used = {node.target for node in graph.graph.nodes if node.op == "get_attr"}
    names = [n for n, _ in graph.named_parameters(remove_duplicate=False)] + [n for n, _ in graph.named_buffers(remove_duplicate=False)]
    for name in names:
        if name not in used:
            module, attr = _owner(graph, name)
            if attr in module._parameters:
                del module._parameters[attr]
            elif attr in module._buffers:
                del module._buffers[attr]


def share_equal_constants(source: torch.fx.GraphModule, target: torch.fx.GraphModule) -> int:
    """Point `target`'s tensors at `source`'s where both graphs hold the same tensor under the same name.

    The graphs of one module quantized with shared observers (hybrid prefill + decode) hold identical quantized
    weights; without this each holds a copy until lowering. Returns the bytes freed.
    """
    freed = 0
    source_tensors = dict(tensor_attributes(source))
    for name, tensor in tensor_attributes(target):
        same = source_tensors.get(name)
        if same is None or same is tensor or same.shape != tensor.shape or same.dtype != tensor.dtype:
            continue
        if torch.equal(same, tensor):
            module, attr = _owner(target, name)
            if attr in module._parameters:
                module._parameters[attr] = source.get_parameter(name)
            elif attr in module._buffers:
                module._buffers[attr] = source.get_buffer(name)
            else:
                setattr(module, attr, same)
            freed += tensor.nbytes
    return freed


def _owner(graph: torch.fx.GraphModule, name: str) -> tuple[nn.Module, str]:
    """The submodule holding the attribute at dotted path `name`, and the attribute's own name."""
    owner, _, attr = name.rpartition(".")
    return (graph.get_submodule(owner) if owner else graph), attr


def tensor_attributes(graph: torch.fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """Tensors that get_attr nodes read: parameters, buffers and plain tensor attributes (folded constants)."""
    out = []
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(graph)
            if isinstance(value, torch.Tensor):
                out.append((node.target, value))
    return out


def map_constants_to_file(graphs, path, min_bytes: int = 1 << 20) -> int:
    """Move the constants of ``graphs`` (their quantized weights, at least ``min_bytes`` each, in anonymous memory)
    into a file mapping at ``path`` (`weights.map_to_file`); a tensor several graphs share stays one tensor.

    From the quantize stage to the end of the lowering the export holds every quantized weight (Gemma-4-E4B: 4.6 GB
    at one byte per 4-bit value) while the QNN compilers, in worker processes, add their working sets: in a file
    mapping they are pages the kernel can drop while a compile needs the memory, and read again when the next shard
    is prepared. Returns the bytes moved; 0, with the constants left where they were, if the file cannot be
    written."""
    attributes = [(graph, name, tensor) for graph in graphs for name, tensor in tensor_attributes(graph)]
    unique = {id(tensor): tensor for _, _, tensor in attributes}
    movable = anonymous_tensors({str(key): tensor for key, tensor in unique.items()}, min_bytes)
    if not movable:
        return 0
    mapped = try_map_to_file(movable, path, "The quantized weights")
    if mapped is None:
        return 0
    # one replacement per tensor, of the same kind, so the graphs that shared it still do
    mapped = {key: nn.Parameter(value, requires_grad=False) if isinstance(unique[int(key)], nn.Parameter) else value
              for key, value in mapped.items()}
    for graph, name, tensor in attributes:
        replacement = mapped.get(str(id(tensor)))
        if replacement is None:
            continue
        module, attr = _owner(graph, name)
        if attr in module._parameters:
            module._parameters[attr] = replacement
        elif attr in module._buffers:
            module._buffers[attr] = replacement
        else:
            setattr(module, attr, replacement)
    del attributes, unique, movable
    gc.collect()  # a replaced Parameter can wait in a reference cycle: its anonymous memory goes now, not later
    return_free_heap()  # glibc keeps freed blocks under its mmap threshold (up to 32 MB) in its heap: give them back
    return sum(t.nbytes for t in mapped.values())
