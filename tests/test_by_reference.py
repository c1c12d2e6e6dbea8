"""optimum_qnn.exporter.by_reference: the weights a lowering hands QNN by reference (equal contents kept once) compile
into the program ExecuTorch's own copies compile into."""

from __future__ import annotations

import contextlib

import pytest

from optimum_qnn.exporter import by_reference, parallel_compile
from tests.htp_graphs import lower_stack

needs_fork = pytest.mark.skipif(not parallel_compile.fork_available(), reason="compile workers need Linux fork")


@needs_fork
def test_weights_handed_to_qnn_by_reference_compile_what_copies_compile(qnn_sdk):
    """`weights_by_reference`: the same program as with ExecuTorch's copies, byte for byte but the contexts' clock
    stamps; each method's equal weights handed over once. Both lowerings run in children forked from this process's
    QNN state (a second lowering in one process numbers its QNN tensors on from the first)."""
    from optimum_qnn.artifacts.inspection.pte import normalized_program
    from optimum_qnn.exporter.forked import run_forked

    def lower(referenced: bool):
        calls = []
        keep = by_reference.KeptArrays.keep

        def counting(self, data):
            calls.append(data.nbytes)
            return keep(self, data)

        by_reference.KeptArrays.keep = counting
        if not referenced:
            parallel_compile.weights_by_reference = lambda kept: contextlib.nullcontext()
        lowered = lower_stack(workers=2)
        return lowered.buffer, calls

    referenced, calls = run_forked(lambda: lower(True), "the lowering by reference")
    copies, no_calls = run_forked(lambda: lower(False), "the lowering with copies")
    assert not no_calls and len(calls) >= 6  # 3 shards x 2 methods, a weight each at least
    assert normalized_program(referenced) == normalized_program(copies)


def test_kept_arrays_hold_equal_contents_once():
    import numpy as np

    kept = by_reference.KeptArrays()
    a = np.arange(1 << 20, dtype=np.int8).reshape(1024, 1024)
    twin, other = a.copy(), a.copy()
    other[512, 7] += 1  # one byte differs
    assert kept.keep(a) is a and kept.keep(twin) is a and kept.keep(other) is other
    assert kept.keep(a.astype(np.uint8)) is not a  # same bytes, another dtype
    assert kept.nbytes == 3 * a.nbytes
