"""QNN's partitions of every method of a lowering, proposed side by side: this process proposes the first method's,
a forked child each other one's, and the partitioner then tags the nodes from them (`edge.lower_edge`).

ExecuTorch's partitioner proposes one method's partitions after the other, on one core, with torch's
`CapabilityBasedPartitioner` (merging the supported nodes into the largest subgraphs without a cycle; its cycle
checks walk the graph once per merge). At full-size Gemma-4-E2B the partitioning of each method took 17-19 s on one
core after the op check, most of it in those merges; the methods' proposals do not depend on each other.

A proposal is kept by node name (with each partition's id and each node's order): a child hands it back so, and
ExecuTorch partitions a copy of each program (`to_backend` deep-copies it with fake weights), over whose nodes
`by_node` rebuilds it: the same partitions, in the same order, as the proposal made in place.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch.fx.passes.infra.partitioner import Partition
from torch.fx.passes.operator_support import OperatorSupportBase

from optimum_qnn.progress import report_step

if TYPE_CHECKING:  # pragma: no cover
    from executorch.exir import EdgeProgramManager

# One partition by name: (id, [(node name, node order), ...]) in the proposal's order.
NamedPartition = tuple[int | None, list[tuple[str, int | None]]]


class NamedNodes(OperatorSupportBase):
    """The partitioner's operator support, answered from the names `edge.supported_nodes` found."""

    def __init__(self, names: frozenset[str]):
        self.names = names

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return node.name in self.names


def propose(graph_module: torch.fx.GraphModule, supported: frozenset[str]) -> list[Partition]:
    """The partitions QNN's partitioner proposes for the nodes named ``supported`` (its own call, with the answer of
    its op check given)."""
    from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
        generate_partitions_from_list_of_nodes,
    )

    return generate_partitions_from_list_of_nodes(graph_module, op_support=NamedNodes(supported))


def proposed_side_by_side(
    edge: EdgeProgramManager, supported: Mapping[str, frozenset[str]], methods: Sequence[str]
) -> dict[str, list[NamedPartition]]:
    """Every method's `propose` partitions, the first method's in this process and each other one's in a forked child.

    Args:
        edge: the edge programs being lowered (not changed).
        supported: method name -> the nodes QNN delegates (`edge.supported_nodes`).
        methods: the methods, in the lowering's order.

    Returns:
        Method name -> its partitions by node name (`by_node` makes them partitions of a graph with those nodes);
        {} for fewer than two methods or without fork (the partitioner then proposes them itself).
    """
    from optimum_qnn.exporter.forked import Forked
    from optimum_qnn.exporter.parallel_compile import fork_available

    if len(methods) < 2 or not fork_available():
        return {}
    report_step("proposing the partitions of " + ", ".join(methods))
    children = {
        name: Forked(functools.partial(_propose_by_name, edge, name, supported[name]), f"the partitioning of {name}")
        for name in methods[1:]
    }
    try:
        proposals = {methods[0]: _propose_by_name(edge, methods[0], supported[methods[0]])}
        for name, child in children.items():
            proposals[name] = child.result()
    except BaseException:
        for child in children.values():
            child.cancel()
        raise
    return {name: proposals[name] for name in methods}


def _propose_by_name(edge: EdgeProgramManager, name: str, supported: frozenset[str]) -> list[NamedPartition]:
    """One method's `propose` partitions by node name."""
    partitions = propose(edge.exported_program(name).graph_module, supported)
    return [(p.id, [(node.name, order) for node, order in p.nodes.items()]) for p in partitions]


def by_node(graph: torch.fx.Graph, named: list[NamedPartition]) -> list[Partition]:
    """The ``named`` partitions over ``graph``'s nodes."""
    nodes = {node.name: node for node in graph.nodes}
    partitions = []
    for pid, members in named:
        partition = Partition(id=pid)
        for node_name, order in members:
            partition.add_node(nodes[node_name], order)
        partitions.append(partition)
    return partitions
