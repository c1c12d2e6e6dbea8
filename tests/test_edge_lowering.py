"""optimum_qnn.exporter.edge and EdgeLowering's conversion to ExecuTorch's edge dialect: provenance pruning, the
portable form a Ray cell receives, and methods converted side by side in forked children (real QNN compiles; the
emulator runs what they make)."""

from __future__ import annotations

import logging
import os
import signal

import torch

import pytest

from optimum_qnn.config import Soc
from tests.htp_graphs import quantized_mlp, run_method


def test_edge_conversion_keeps_each_node_s_oldest_source_only(qnn_sdk, monkeypatch):
    """`edge.prune_provenance` between the edge passes: the edge program and every node's debug handle (ExecuTorch's,
    from the node's oldest source) are those of the conversion that keeps every node's whole provenance record,
    whose records grow with each pass."""
    from optimum_qnn.exporter import edge as edge_module
    from optimum_qnn.exporter.lowering import EdgeLowering

    _, x, converted = quantized_mlp(8)

    def converted_to_edge():
        lowering = EdgeLowering({"forward": torch.export.export(converted, (x,), strict=True)}, fp16=False)
        lowering.prepare()
        return lowering._edge.exported_program("forward")

    def levels(source) -> int:
        return 1 + max((levels(s) for s in source.from_node), default=0)

    def described(program):
        nodes = [n for n in program.graph.nodes if n.op not in ("placeholder", "output")]
        handles = [(n.name, n.meta.get("debug_handle")) for n in nodes]
        depth = max(levels(s) for n in nodes for s in n.meta.get("from_node", []))
        return program.graph_module.code, handles, depth

    pruned_code, pruned_handles, pruned_depth = described(converted_to_edge())
    monkeypatch.setattr(edge_module, "prune_provenance", lambda graph_module: None)
    monkeypatch.setattr(edge_module, "_pruned_after_each", list)
    code, handles, depth = described(converted_to_edge())
    assert pruned_code == code and pruned_handles == handles
    assert sum(1 for _, h in handles if h) >= 5  # ExecuTorch did number them, from each node's oldest source
    assert pruned_depth <= 3 < depth  # what each pass had to copy


def test_a_portable_lowering_lowers_in_another_process(qnn_sdk, run_python, tmp_path):
    """`EdgeLowering.portable()` is what a Ray cell receives: a PT2E-quantized graph saved with torch.export, which
    a fresh interpreter (no quantizer imported) loads and lowers into the program this process makes from the
    same graph: the same QNN contexts (graphs, IO, encodings) and bit-equal outputs on the emulator."""
    import pickle

    from optimum_qnn.artifacts.inspection import inspect_bytes
    from optimum_qnn.exporter.lowering import EdgeLowering

    _, x, converted = quantized_mlp(0)
    portable = EdgeLowering({"forward": (converted, (x,))}, fp16=False, constant_methods={"get_ar_len": 4}).portable()
    (tmp_path / "portable.pickle").write_bytes(pickle.dumps(portable))
    code = (
        "import pickle, sys\n"
        "from optimum_qnn.config import Soc\n"
        "from optimum_qnn.exporter.lowering import EdgeLowering\n"
        "lowering = EdgeLowering.from_portable(pickle.load(open(sys.argv[1], 'rb')))\n"
        "lowering.lower(Soc.SM8650, path=sys.argv[2], keep=False)\n"
    )
    proc = run_python("-c", code, str(tmp_path / "portable.pickle"), str(tmp_path / "there.pte"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    there = (tmp_path / "there.pte").read_bytes()
    here = EdgeLowering.from_portable(pickle.loads((tmp_path / "portable.pickle").read_bytes())).lower(
        Soc.SM8650, keep=False
    ).buffer
    assert inspect_bytes(there).to_dict() == inspect_bytes(here).to_dict()
    (tmp_path / "here.pte").write_bytes(here)
    for out, ref in zip(run_method(tmp_path / "there.pte", "forward", (x,)), run_method(tmp_path / "here.pte", "forward", (x,)),
                        strict=True):
        assert torch.equal(out, ref)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="methods are converted side by side on Linux only")
def test_methods_converted_side_by_side_make_the_program_one_process_makes(qnn_sdk, monkeypatch, caplog):
    """`EdgeLowering` converts every method but the first in a forked child, which hands its edge program back
    (`program_transfer`): the lowering then makes the program converting both methods here makes (a PT2E-quantized
    pair: the QNN passes' encodings travel in the nodes' metadata), the child's weights come back as
    this process's own tensors, not copies, neither keeps its example inputs, and a child that fails or dies is an
    error here."""
    from optimum_qnn.artifacts.inspection.pte import normalized_program
    from optimum_qnn.exporter import edge as edge_module
    from optimum_qnn.exporter.lowering import EdgeLowering

    _, x, converted = quantized_mlp(8)
    methods = {"prefill_forward": (converted, (x,)), "kv_forward": (converted, (x * 2,))}

    def lowering(parallel: bool) -> EdgeLowering:
        monkeypatch.setattr(EdgeLowering, "parallel_edge", parallel)
        made = EdgeLowering(methods, fp16=False, constant_methods={"get_ar_len": 4})
        made.prepare()
        return made

    with caplog.at_level(logging.INFO, logger="optimum_qnn.progress"):
        side_by_side = lowering(True)
    steps = [r.getMessage() for r in caplog.records if r.name == "optimum_qnn.progress"]
    assert any("handing kv_forward to the export's process" in s for s in steps), steps  # it came from a child
    here = lowering(False)
    storages = {t.untyped_storage().data_ptr() for _, t in converted.state_dict().items()}
    storages |= {t.untyped_storage().data_ptr() for m in converted.modules() for t in vars(m).values()
                 if isinstance(t, torch.Tensor)}
    taken = side_by_side._edge.exported_program("kv_forward")
    weights = [t for t in [*taken.state_dict.values(), *taken.constants.values()] if t.numel() > 1]
    assert weights and all(t.untyped_storage().data_ptr() in storages for t in weights)
    for name in methods:  # the same graphs, node for node, with the same metadata keys
        a, b = (p._edge.exported_program(name).graph for p in (side_by_side, here))
        # and no example inputs kept past the re-export (a language model's are its float32 caches: GBs at 32K)
        assert all(p._edge.exported_program(name).example_inputs is None for p in (side_by_side, here))
        assert [(n.name, str(n.target), sorted(n.meta)) for n in a.nodes] == [
            (n.name, str(n.target), sorted(n.meta)) for n in b.nodes]
    # Each SoC lowered in a forked child (keep=True): QNN's counters here stay put, so the programs compare.
    assert normalized_program(side_by_side.lower(Soc.SM8650, weight_sharing=False).buffer) == normalized_program(
        here.lower(Soc.SM8650, weight_sharing=False).buffer)

    def fail(*args, **kwargs):
        raise ValueError("refused in the child")

    monkeypatch.setattr(EdgeLowering, "parallel_edge", True)
    with monkeypatch.context() as m:
        m.setattr(edge_module, "_convert_and_dump", fail)
        with pytest.raises(ValueError, match="refused in the child"):
            EdgeLowering(methods, fp16=False).prepare()
        m.setattr(edge_module, "_convert_and_dump", lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
        with pytest.raises(RuntimeError, match="edge conversion of kv_forward was killed by signal SIGKILL") as killed:
            EdgeLowering(methods, fp16=False).prepare()
        # the advice fits the work that was killed: convert one method at a time, not fewer SoCs
        assert "OPTIMUM_QNN_EDGE_SIDE_BY_SIDE=off" in str(killed.value) and "SoCs" not in str(killed.value)
