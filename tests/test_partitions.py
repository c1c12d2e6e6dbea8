"""optimum_qnn.exporter.partitions and edge.supported_nodes: the op check and the partition proposal made side by side
in forked processes give the partitioner what its own one-process check and proposal give (real QNN op checks)."""

from __future__ import annotations

import copy

import pytest

from optimum_qnn.exporter import parallel_compile
from tests.htp_graphs import stack_and_inputs

needs_fork = pytest.mark.skipif(not parallel_compile.fork_available(), reason="compile workers need Linux fork")


@needs_fork
def test_the_op_check_side_by_side_finds_what_the_partitioner_checks(qnn_sdk):
    """`edge.supported_nodes` with 2 processes (each every other node) gives the partitioner the set its own check
    over every node in one process gives; the shards' CPU hand-over ops are the nodes left out."""
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext

    from optimum_qnn.config import Soc
    from optimum_qnn.exporter.edge import SHARD_OP, _supported_share, method_names, supported_nodes
    from optimum_qnn.exporter.lowering import EdgeLowering, compile_specs

    module, inputs = stack_and_inputs()
    lowering = EdgeLowering({name: (module, example) for name, example in inputs.items()}, fp16=True, shard_starts=(1, 2))
    lowering.prepare()
    edge = lowering._edge
    spec = compile_specs(Soc.SM8650, fp16=True, multiple_graphs=True, weight_sharing=False, multiple_contexts=True)
    skip = {SHARD_OP}
    with QnnManagerContext({name: spec for name in method_names(edge)}):
        side_by_side = supported_nodes(edge, spec, skip, workers=2)
        alone = _supported_share(edge, spec, frozenset(skip), 1, 0)
        assert supported_nodes(edge, spec, skip, workers=1) == {}  # the partitioner checks them itself
    assert side_by_side == {name: frozenset(nodes) for name, nodes in alone.items()}
    for name in method_names(edge):
        calls = [n for n in edge.exported_program(name).graph.nodes if n.op == "call_function"]
        left_out = {n.target.__name__ for n in calls if n.name not in side_by_side[name]}
        assert len(side_by_side[name]) > 10 and left_out == {SHARD_OP}, (name, left_out)


@needs_fork
def test_partitions_proposed_side_by_side_are_the_partitioner_s_own(qnn_sdk):
    """`partitions.proposed_side_by_side` (the second method's proposal made in a forked child and handed back by
    node name) gives every method the partitions ExecuTorch's own proposal makes in place: the same ids, nodes and
    node orders, in the same order, rebuilt over the nodes of a copy of the program (ExecuTorch partitions one); one
    partition per shard."""
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext
    from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
        generate_partitions_from_list_of_nodes,
    )

    from optimum_qnn.config import Soc
    from optimum_qnn.exporter.edge import SHARD_OP, method_names, supported_nodes
    from optimum_qnn.exporter.lowering import EdgeLowering, compile_specs
    from optimum_qnn.exporter.partitions import NamedNodes, by_node, proposed_side_by_side

    module, inputs = stack_and_inputs()
    lowering = EdgeLowering({name: (module, example) for name, example in inputs.items()}, fp16=True, shard_starts=(1, 2))
    lowering.prepare()
    edge = lowering._edge
    methods = method_names(edge)
    spec = compile_specs(Soc.SM8650, fp16=True, multiple_graphs=True, weight_sharing=False, multiple_contexts=True)
    with QnnManagerContext({name: spec for name in methods}):
        supported = supported_nodes(edge, spec, {SHARD_OP}, workers=2)
    proposed = proposed_side_by_side(edge, supported, methods)
    assert list(proposed) == methods and len(methods) == 2
    for name in methods:
        graph_module = copy.deepcopy(edge.exported_program(name).graph_module)
        own = generate_partitions_from_list_of_nodes(graph_module, op_support=NamedNodes(supported[name]))
        assert len(own) == 3  # the three shards, split at the CPU hand-over ops
        rebuilt = by_node(graph_module.graph, proposed[name])
        assert [(p.id, list(p.nodes.items())) for p in rebuilt] == [(p.id, list(p.nodes.items())) for p in own]
    assert proposed_side_by_side(edge, supported, methods[:1]) == {}  # one method: the partitioner proposes it
