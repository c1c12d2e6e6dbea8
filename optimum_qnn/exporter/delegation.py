"""What of a lowered program runs on QNN and what stays on the CPU, per method (split from lowering.py)."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from executorch.exir import EdgeProgramManager

QNN_BACKEND_ID = "QnnBackend"


@dataclass(frozen=True)
class MethodDelegation:
    """What of one method runs on QNN and what stays on the CPU.

    Args:
        method: the method name.
        partitions: number of QNN delegate calls in the method.
        delegated: number of ops inside the QNN partitions.
        on_cpu: ops left on the CPU, op name -> count (`getitem` bookkeeping excluded).
    """

    method: str
    partitions: int
    delegated: int
    on_cpu: dict[str, int] = field(default_factory=dict)

    @property
    def cpu_ops(self) -> int:
        return sum(self.on_cpu.values())

    @property
    def fully_delegated(self) -> bool:
        return self.partitions == 1 and not self.on_cpu


def delegation_summary(edge: EdgeProgramManager) -> dict[str, MethodDelegation]:
    """Per method of a lowered edge program: QNN partitions, ops inside them, ops left on the CPU."""
    from executorch.exir.delegate import executorch_call_delegate

    from optimum_qnn.exporter.edge import method_names

    summary = {}
    for method in method_names(edge):  # in the methods' order: `edge.methods` is a set
        graph_module = edge.exported_program(method).graph_module
        partitions, delegated, on_cpu = 0, 0, Counter()
        for node in graph_module.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            if node.target is executorch_call_delegate:
                lowered = getattr(graph_module, node.args[0].target)
                if lowered.backend_id == QNN_BACKEND_ID:
                    partitions += 1
                    delegated += sum(
                        n.op == "call_function" and n.target is not operator.getitem
                        for n in lowered.original_module.graph.nodes
                    )
                    continue
            on_cpu[_op_name(node.target)] += 1
        summary[method] = MethodDelegation(method, partitions, delegated, dict(on_cpu))
    return summary


def _op_name(target: Any) -> str:
    """`aten.erf.default` for ATen and edge ops (whose str() is a long schema dump), else the callable's name."""
    return getattr(target, "__name__", None) or str(target)


def format_delegation(summary: Mapping[str, MethodDelegation]) -> str:
    """A small table: method, QNN partitions, ops on QNN, ops on CPU (with their names)."""
    rows = [("method", "partitions", "on QNN", "on CPU", "CPU ops")]
    for d in summary.values():
        cpu = ", ".join(f"{op} x{n}" for op, n in sorted(d.on_cpu.items())) or "-"
        rows.append((d.method, str(d.partitions), str(d.delegated), str(d.cpu_ops), cpu))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
