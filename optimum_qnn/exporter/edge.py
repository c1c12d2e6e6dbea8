"""ExecuTorch's QNN lowering (`to_edge_transform_and_lower_to_qnn` in 1.5.1) in its two halves, for
`optimum_qnn.exporter.lowering.EdgeLowering`: `to_edge` (QNN's export passes, edge conversion, QNN's edge passes: no
SoC read) and `lower_edge` (QNN's partitioner and compiler for one SoC's compile specs), with the hooks the exporter
adds to them (progress steps, integer graph IO, shards, preprocessing copies that share their weights).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, Union

import torch

from optimum_qnn.exporter.parallel_compile import parallel_shard_compiles
from optimum_qnn.exporter.partitions import NamedNodes, by_node, propose, proposed_side_by_side
from optimum_qnn.progress import report_step

if TYPE_CHECKING:  # pragma: no cover
    from executorch.exir import EdgeProgramManager
    from executorch.exir.backend.compile_spec_schema import CompileSpec

logger = logging.getLogger(__name__)
# Set to off (`environment.OFF`), the methods are converted to the edge dialect one after the other (`EdgeLowering.parallel_edge`).
EDGE_SIDE_BY_SIDE_VARIABLE = "OPTIMUM_QNN_EDGE_SIDE_BY_SIDE"

# The static model's decoder layers are `layers.N` (optimum_qnn.models.gemma4.modules).
_LAYER_PATTERN = r"layers\.(\d+)"
SHARD_OP = "llama.fallback.default"
# A method is an exported program or a module with its positional example inputs.
MethodSource: TypeAlias = Union[torch.export.ExportedProgram, tuple[torch.nn.Module, tuple[Any, ...]]]


def _passes_job(int64_inputs: Collection[str], shard_starts: Collection[int], quant_io_dtype=None):
    """ExecuTorch's default QNN pass list and its ordering constraints, with `I64toI32` told to leave
    ``int64_inputs`` alone and, for shards, ExecuTorch's `SplitGraph` inserting `llama::fallback` before each layer
    of ``shard_starts`` (after Q/DQ folding, so the op carries the quantization of the tensor it passes on).
    ``quant_io_dtype(node)`` turns on `TagQuantIO`: the IO nodes it names a dtype for stay integer."""
    if not int64_inputs and not shard_starts and quant_io_dtype is None:
        return None, None
    from executorch.backends.qualcomm._passes import FoldQDQ, I64toI32, TagQuantIO
    from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
    from executorch.backends.qualcomm.utils.constants import (
        QCOM_PASS_ACTIVATE_KEY,
        QCOM_PASS_ARGS_KWARGS_DEFAULTS_KEY,
    )

    manager_cls = get_qnn_pass_manager_cls()
    job = manager_cls.get_capture_program_passes()  # the HTP pass list
    job[I64toI32][QCOM_PASS_ARGS_KWARGS_DEFAULTS_KEY]["skip_node"] = frozenset(int64_inputs)
    if quant_io_dtype is not None:
        job[TagQuantIO][QCOM_PASS_ACTIVATE_KEY] = True
        job[TagQuantIO][QCOM_PASS_ARGS_KWARGS_DEFAULTS_KEY]["get_quant_io_dtype_fn"] = quant_io_dtype
    deps = None
    if shard_starts:
        from executorch.extension.llm.custom_ops.model_sharding import SplitGraph

        job[SplitGraph] = {
            QCOM_PASS_ACTIVATE_KEY: True,
            QCOM_PASS_ARGS_KWARGS_DEFAULTS_KEY: {"shard_layers": sorted(shard_starts), "pattern": _LAYER_PATTERN},
        }
        deps = manager_cls.get_passes_dependency_for_capture_program()
        deps[SplitGraph] = [FoldQDQ]
        deps[TagQuantIO] = [*deps.get(TagQuantIO, []), SplitGraph]
    return job, deps


def export_method(name: str, source: MethodSource) -> torch.export.ExportedProgram:
    """A fresh ExportedProgram of one method (the QNN passes rewrite it in place, so each lowering gets its own).

    Non-strict: the graphs are already ATen graphs (ours, or PT2E's converted ones), so Dynamo has nothing to add;
    ExecuTorch's `to_edge_transform_and_lower_to_qnn` re-exports strictly, which was 16% of a lowering's wall time.
    """
    if isinstance(source, torch.export.ExportedProgram):
        args, kwargs = source.example_inputs or ((), {})
        if kwargs:
            raise ValueError(f"Method {name!r}: exported with keyword inputs; QNN methods take positional inputs only")
        module, inputs = source.module(), tuple(args)
    elif isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], torch.nn.Module):
        module, inputs = source[0], tuple(source[1])
    else:
        raise TypeError(f"Method {name!r}: expected an ExportedProgram or (module, example_inputs); got {type(source).__name__}")
    return torch.export.export(module, inputs, strict=False)


def to_edge(
    exported: Mapping[str, torch.export.ExportedProgram],
    spec: list[CompileSpec],
    *,
    constant_methods: Mapping[str, Any] | None,
    skip_ops: Collection[str],
    int64_inputs: Collection[str],
    shard_starts: Mapping[str, Collection[int]],
    quantized_io: Mapping[str, Collection[int]],
    float_outputs: Mapping[str, Collection[int]] | None = None,
) -> EdgeProgramManager:
    """The first half of ExecuTorch's `to_edge_transform_and_lower` as `to_edge_transform_and_lower_to_qnn` (1.5.1)
    calls it: QNN's export passes, edge conversion keeping the ops QNN's partitioner wants whole, QNN's edge passes.
    ``shard_starts``: per method, the layers that begin a shard; ``float_outputs``: per method of ``quantized_io``,
    output positions that stay float32 (see `EdgeLowering`)."""
    from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
    from executorch.backends.qualcomm.utils.utils import (
        flatbuffer_to_option,
        generate_qnn_executorch_option,
        qnn_edge_config,
    )
    # Private to EXIR (pinned 1.5.1): the two halves of to_edge_transform_and_lower, which has no public split.
    from executorch.exir.program._program import _gen_edge_manager_for_partitioners, lift_constant_tensor_pass

    backend_type = flatbuffer_to_option(generate_qnn_executorch_option(spec)).backend_options.backend_type
    aten, transform_passes, partitioners, taggers = {}, {}, {}, {}
    report_step("running QNN's export passes")
    for name, program in exported.items():
        tagger = None
        if name in quantized_io:
            user_inputs = program.graph_signature.user_inputs
            tagger = taggers[name] = _QuantIoTagger({user_inputs[i] for i in quantized_io[name]},
                                                    (float_outputs or {}).get(name, ()))
        passes_job, dep_table = _passes_job(int64_inputs, shard_starts.get(name, ()), tagger)
        manager = get_qnn_pass_manager_cls(backend_type)()
        # Before edge conversion: these passes add constants that lift_constant_tensor_pass must lift.
        prune_provenance(program.graph_module)
        aten[name] = manager.transform_for_export_pipeline(program)
        prune_provenance(aten[name].graph_module)
        transform_passes[name] = [_reporting_pass(f"running QNN's edge passes on {name}")]
        transform_passes[name] += _pruned_after_each(manager.get_to_edge_transform_passes(
            program,
            passes_job=passes_job,
            dep_table=dep_table,
            compiler_specs=spec,
            skip_node_op_set=set(skip_ops),
            # Linear layers as 1x1 convolutions: the HTP's fast path, and the only form in which block-quantized
            # (LPBQ) weights compile ("no properties registered for q::GenPad" otherwise).
            convert_linear_to_conv2d=True,
        ))
        # Asked only which ops to keep whole through the decompositions (a fixed table), never to partition.
        partitioners[name] = [_reporting_partitioner()(spec, skip_node_op_set=set(skip_ops), method=name)]
    edge = _gen_edge_manager_for_partitioners(
        partitioners, aten, qnn_edge_config(), dict(constant_methods) if constant_methods else None
    )
    edge = edge.transform(transform_passes)
    for name in edge.methods:
        lift_constant_tensor_pass(edge.exported_program(name))
        prune_provenance(edge.exported_program(name).graph_module)  # the partitioning and serialization copy it too
    for name, tagger in taggers.items():
        tagger.check(name)
    return edge


def release_example_inputs(edge: EdgeProgramManager, methods: Collection[str]) -> None:
    """Let the edge programs' example inputs go: the re-export traced with them, and nothing after it runs a graph
    (partitioning, compiling and serializing read shapes from the graphs' metadata). A language model's are its zero
    KV caches in float32, the context's size: about 1 GB per method for Gemma-4-E4B at 32768 tokens (its sliding
    layers' rings aside), which were held through the lowering beside the QNN compiles."""
    for name in methods:
        edge.exported_program(name).example_inputs = None


def to_edge_in_parallel(
    sources: Mapping[str, Callable[[], torch.export.ExportedProgram]],
    shared_tensors: Iterable[torch.Tensor],
    spec: list[CompileSpec],
    *,
    constant_methods: Mapping[str, Any] | None,
    **options: Any,
) -> EdgeProgramManager:
    """`to_edge` with the methods converted side by side: the first in this process, each other one in a forked
    child that hands its edge program back through `optimum_qnn.exporter.program_transfer` (the weights it still
    shares with this process as references, not copies). ExecuTorch converts one method after the other on one core,
    and converting a method is independent of the others until they are lowered together.

    Args:
        sources: method name -> a function that makes its exported program (called in the process that converts it).
        shared_tensors: every weight and constant tensor the sources hold (made before the children are forked).
        spec, constant_methods, options: see `to_edge`.

    Returns:
        The same `EdgeProgramManager` `to_edge` makes of all the methods, in the order of ``sources``.
    """
    import tempfile
    from pathlib import Path

    from executorch.exir.program._program import collect_named_data_store_from_exported_program

    from optimum_qnn.exporter import program_transfer
    from optimum_qnn.exporter.forked import Forked

    names = list(sources)
    shared = program_transfer.SharedTensors(shared_tensors)
    children: dict[str, tuple[Forked, Path]] = {}
    with tempfile.TemporaryDirectory(prefix="optimum-qnn-edge-") as folder:
        try:
            for name in names[1:]:
                path = Path(folder) / f"{name}.program"
                convert = functools.partial(_convert_and_dump, name, sources[name], spec, options, shared, path)
                children[name] = Forked(
                    convert, f"the edge conversion of {name}",
                    f"run with {EDGE_SIDE_BY_SIDE_VARIABLE}=off to convert the methods one after the other, in less memory",
                ), path
            edge = to_edge({names[0]: sources[names[0]]()}, spec, constant_methods=constant_methods, **options)
            programs = {names[0]: edge.exported_program(names[0])}
            preserved = set(edge.compile_config._core_aten_ops_exception_list)
            for name, (child, path) in children.items():
                preserved |= {program_transfer.op_from_name(op) for op in child.result()}
                report_step(f"taking {name} from its process")
                logger.debug("%s's edge program: %.1f MB handed over", name, path.stat().st_size / 2**20)
                with path.open("rb") as f:
                    programs[name] = program_transfer.load(f, shared)
                path.unlink()
        except BaseException:
            for child, _ in children.values():
                child.cancel()
            raise
    # The manager `to_edge` would have made of every method, in the methods' order (the lowering keeps it).
    edge._edge_programs = {name: programs[name] for name in names}
    for name in names[1:]:
        collect_named_data_store_from_exported_program(programs[name], edge._named_data_store)
    edge.compile_config._core_aten_ops_exception_list = sorted(preserved, key=str)
    return edge


def _convert_and_dump(name, source, spec, options, shared, path) -> list[str]:
    """In a child of `to_edge_in_parallel`: convert one method and write it to `path`; the ops its conversion kept
    whole (by name: op overloads do not pickle)."""
    from optimum_qnn.exporter import program_transfer

    edge = to_edge({name: source()}, spec, constant_methods=None, **options)
    release_example_inputs(edge, [name])  # not handed back: the parent would only let them go
    report_step(f"handing {name} to the export's process")
    with path.open("wb") as f:
        program_transfer.dump(edge.exported_program(name), f, shared)
    return [program_transfer.op_name(op) for op in edge.compile_config._core_aten_ops_exception_list]


def lower_edge(
    edge: EdgeProgramManager, spec: list[CompileSpec], *, skip_ops: Collection[str], workers: int,
    budget_gb: float | None,
) -> EdgeProgramManager:
    """The second half of `to_edge_transform_and_lower` for one SoC: QNN's partitioner and compiler (`to_backend`),
    then ExecuTorch's check that every op kept whole was delegated."""
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext
    from executorch.exir.program._program import (
        _can_skip_using_EDGE_DO_NOT_DECOMP,
        _remove_invalid_ops_for_not_decompose,
        _sanity_check_graph_for_non_decomp_ops,
    )

    # In the methods' own order: `EdgeProgramManager.methods` is a set, whose order changes with the interpreter's hash
    # seed, and the partitioners' order is the order of the methods' graphs in each context binary.
    methods = method_names(edge)
    with (
        QnnManagerContext({name: spec for name in methods}),
        _preprocess_copies_share_weights(),
        parallel_shard_compiles(workers, budget_gb),
    ):
        supported = supported_nodes(edge, spec, skip_ops, workers)
        proposed = proposed_side_by_side(edge, supported, methods) if supported else {}
        partitioners = {
            name: _reporting_partitioner()(spec, skip_node_op_set=set(skip_ops), method=name, supported=supported.get(name),
                                           partitions=proposed.get(name))
            for name in methods
        }
        edge = edge.to_backend(partitioners)
    for name, partitioner in partitioners.items():
        program = edge.exported_program(name)
        keep_whole, check_op_support = partitioner.ops_to_not_decompose(program)
        if not _can_skip_using_EDGE_DO_NOT_DECOMP(partitioner, program):
            keep_whole = _remove_invalid_ops_for_not_decompose(keep_whole)
        _sanity_check_graph_for_non_decomp_ops(
            name, program, set(keep_whole), check_op_support, partitioner_name=type(partitioner).__name__,
            generate_error=True,
        )
    return edge


def supported_nodes(edge: EdgeProgramManager, spec: list[CompileSpec], skip_ops: Collection[str],
                    workers: int) -> dict[str, frozenset[str]]:
    """The nodes of each method that QNN's partitioner would delegate, checked side by side: this process and
    ``workers - 1`` forked children each take every ``workers``-th node. {} where fork is unavailable or
    ``workers`` is 1 (the partitioner then checks them itself).

    The check is the partitioner's own (`QnnOperatorSupport`: each node's op wrappers built and validated by the QNN
    backend, one node at a time, nothing kept between nodes), and most of its cost. Measured on a full-size
    Gemma-4-E2B lowering (SM8650, 16a4w_block): partitioning took 44 + 43 s on one core; with the check side by side
    on 2 cores, 36 s for the check and 12 + 10 s for the partitioning that follows. Must run inside the lowering's
    `QnnManagerContext` (the children use its manager)."""
    from optimum_qnn.exporter.forked import Forked
    from optimum_qnn.exporter.parallel_compile import fork_available

    if workers < 2 or not fork_available():
        return {}
    report_step("checking which ops QNN supports")
    check = functools.partial(_supported_share, edge, spec, frozenset(skip_ops), workers)
    children = [Forked(functools.partial(check, rank), f"the QNN op check ({rank + 1} of {workers})")
                for rank in range(1, workers)]
    try:
        found = check(0)
        for child in children:
            for name, nodes in child.result().items():
                found[name] |= nodes
    except BaseException:
        for child in children:
            child.cancel()
        raise
    return {name: frozenset(nodes) for name, nodes in found.items()}


def _supported_share(edge: EdgeProgramManager, spec, skip_ops: frozenset[str], ranks: int, rank: int) -> dict[str, set[str]]:
    """`supported_nodes` for the call_function nodes of every ``ranks``-th position from ``rank``, counted over
    the methods in order (the costly checks, of the weight-bearing ops, spread evenly)."""
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnOperatorSupport

    found: dict[str, set[str]] = {}
    position = 0
    for name in method_names(edge):
        program = edge.exported_program(name)
        support = QnnOperatorSupport(program, spec, set(), set(skip_ops))
        found[name] = set()
        for node in program.graph_module.graph.nodes:
            if node.op != "call_function":
                continue
            if position % ranks == rank and support.is_node_supported(None, node):
                found[name].add(node.name)
            position += 1
    return found


def method_names(edge: EdgeProgramManager) -> list[str]:
    """The methods of ``edge`` in the order they were given (`EdgeProgramManager.methods` is a set)."""
    return list(edge._edge_programs)


def copy_sharing_tensors(edge: EdgeProgramManager) -> EdgeProgramManager:
    """A copy of the edge programs that a lowering may rewrite (it removes the constants it delegates, replaces
    graphs and signatures) without touching the original, and that shares the original's weight tensors: lowering
    never writes into a tensor."""
    return copy.deepcopy(edge, _tensors_kept(*(edge.exported_program(name) for name in edge.methods)))


def _tensors_kept(*programs: torch.export.ExportedProgram) -> dict[int, torch.Tensor]:
    """A `copy.deepcopy` memo that keeps the programs' weight and constant tensors as they are (shared, not copied)."""
    return {id(t): t for p in programs for t in [*p.state_dict.values(), *p.constants.values()] if isinstance(t, torch.Tensor)}


def prune_provenance(graph_module: torch.fx.GraphModule) -> None:
    """Keep of each node's provenance (``meta["from_node"]``) only its oldest source, the one ExecuTorch reads.

    Every node a pass re-creates records where it came from (`torch.fx.traceback.NodeSource`) by deep-copying the
    whole record of the node it came from, so the records grow by one level per pass and each pass copies them
    whole: at Gemma-4-E2B's depth 10-12 % of the edge conversion's CPU time went to those copies (py-spy, 7 and 35
    layers). ExecuTorch reads only the oldest source, at the end of the last entries (`debug_handle_utils.
    get_greatest_ancestor_node_identifier`: the node's debug handle); it is kept, so every debug handle is the same."""
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            sources = node.meta.get("from_node")
            if not sources:
                continue
            oldest = sources[-1]
            while oldest.from_node:
                oldest = oldest.from_node[-1]
            node.meta["from_node"] = [oldest]


def _pruned_after_each(passes: list) -> list:
    """``passes`` with `prune_provenance` after each one."""
    from torch.fx.passes.infra.pass_base import PassResult

    def prune(graph_module: torch.fx.GraphModule) -> PassResult:
        prune_provenance(graph_module)
        return PassResult(graph_module, False)

    return [step for edge_pass in passes for step in (edge_pass, prune)]


def _reporting_pass(step: str):
    """A first edge pass that only reports the step to the export's progress (the edge passes of a method take
    minutes at Gemma-4-E2B's size)."""
    from torch.fx.passes.infra.pass_base import PassResult

    def report(graph_module: torch.fx.GraphModule) -> PassResult:
        report_step(step)
        return PassResult(graph_module, False)

    return report


@functools.cache
def _reporting_partitioner() -> type:
    """ExecuTorch's `QnnPartitioner`, reporting to the export's progress when a method's edge conversion starts (the
    hook EXIR calls first, once per method: ExecuTorch's decompositions then take most of a lowering's Python time)
    and when its partitioning does."""
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner

    class ReportingQnnPartitioner(QnnPartitioner):
        def __init__(self, *args, method: str, supported: frozenset[str] | None = None, partitions: list | None = None,
                     **kwargs):
            super().__init__(*args, **kwargs)
            self.method = method
            self.supported = supported  # the nodes `supported_nodes` found QNN delegates; None: check them here
            self.partitions = partitions  # proposed from them (`partitions.proposed_side_by_side`); None: propose here

        def generate_partitions(self, edge_program):
            if self.supported is None:
                return super().generate_partitions(edge_program)
            self.op_support_checker = NamedNodes(self.supported)  # `partition` deletes it after this call
            if self.partitions is not None:  # by name: ExecuTorch partitions a copy of the program
                return by_node(edge_program.graph_module.graph, self.partitions)
            return propose(edge_program.graph_module, self.supported)

        def transform_for_pre_decomposition(self, exported_program):
            report_step(f"converting {self.method} to the edge dialect")
            return super().transform_for_pre_decomposition(exported_program)

        def partition(self, edge_program):
            report_step(f"partitioning {self.method}")
            return super().partition(edge_program)

    return ReportingQnnPartitioner


class _QuantIoTagger:
    """`TagQuantIO`'s ``get_quant_io_dtype_fn``: the named input placeholders and every graph output but those at
    ``float_outputs`` (positions) keep the integer dtype of the encoding Q/DQ folding left on them (so no Q/DQ is
    inserted at the delegate's boundary); a float output is dequantized inside the delegate."""

    def __init__(self, input_names: Collection[str], float_outputs: Collection[int] = ()):
        self.input_names = frozenset(input_names)
        self.float_outputs = frozenset(float_outputs)
        self.inputs: set[str] = set()
        self.outputs: set[int] = set()  # positions of the tagged graph outputs
        self.n_outputs = 0

    def __call__(self, node: torch.fx.Node):
        from executorch.backends.qualcomm.utils.constants import QCOM_QUANT_ATTRS, QCOM_QUANT_MAX, QCOM_QUANT_MIN

        from optimum_qnn.quantization.io import io_dtype

        attrs = node.meta.get(QCOM_QUANT_ATTRS)
        if attrs is None:
            return None
        if node.op == "placeholder" and node.name in self.input_names:
            self.inputs.add(node.name)
        elif outputs := [user for user in node.users if user.op == "output"]:
            results = outputs[0].args[0]
            self.n_outputs = len(results)
            positions = {i for i, result in enumerate(results) if result is node}
            if positions <= self.float_outputs:
                return None
            self.outputs |= positions
        else:
            return None
        return io_dtype(attrs[QCOM_QUANT_MIN], attrs[QCOM_QUANT_MAX])

    def check(self, method: str) -> None:
        """Every requested input and every graph output not kept float was tagged (an untagged one would silently
        stay float)."""
        missing = sorted(self.input_names - self.inputs)
        untagged = set(range(self.n_outputs)) - self.outputs - self.float_outputs
        if missing or untagged or (not self.n_outputs and not self.float_outputs):
            raise RuntimeError(
                f"{method}: integer IO was not applied to inputs {missing} / outputs {sorted(untagged)} (no "
                "quantization encoding on them after Q/DQ folding); export with --float-io"
            )


@contextlib.contextmanager
def _preprocess_copies_share_weights() -> Iterator[None]:
    """Let QnnBackend's preprocessing copies of the partitions share their weight tensors with the originals.

    Before compiling, ExecuTorch deep-copies every partition of every method (`BackendDetails.
    copy_exported_program_for_preprocess`, the hook a backend may override), all at once: a second copy of every HTP
    weight, and a third where prefill and decode shared theirs (measured +2.4 GB at E2B widths, 7 layers). QNN's
    preprocessing passes replace entries of the copy's `state_dict`/`constants` (`builders.utils.set_parameter`) and
    never write into a tensor, so the copy needs its own graph and dicts but not its own tensor data.
    """
    from executorch.backends.qualcomm.qnn_preprocess import QnnBackend

    def copy_sharing_weights(cls, program, compile_specs):
        return copy.deepcopy(program, _tensors_kept(program))

    saved = QnnBackend.__dict__.get("copy_exported_program_for_preprocess")
    QnnBackend.copy_exported_program_for_preprocess = classmethod(copy_sharing_weights)
    try:
        yield
    finally:
        if saved is None:
            del QnnBackend.copy_exported_program_for_preprocess
        else:
            QnnBackend.copy_exported_program_for_preprocess = saved
