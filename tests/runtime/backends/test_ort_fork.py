"""An export's forked children (edge conversion, HTP compiles) in a process that has run onnxruntime-qnn programs.

A forked child that garbage-collects what it inherited runs the finalizers of the parent's dropped onnxruntime
sessions, whose native threads do not exist in the child: it segfaulted (SIGSEGV, measured with an OrtProgram in a
reference cycle; the fresh-clone suite lost an export that way). The children freeze what they inherit."""

from __future__ import annotations

import gc

from optimum_qnn.artifacts.manifest import read_manifest
from optimum_qnn.exporter.forked import run_forked
from optimum_qnn.runtime.backends.onnxruntime import OrtProgram


def _collect() -> bool:
    gc.collect()
    return True


def test_a_forked_child_never_finalizes_the_parents_onnxruntime_programs(a16w8_export):
    folder = next((a16w8_export("hybrid") / "qnn").glob("*/*"))
    gc.disable()  # the dropped program stays uncollected here until the child has run
    try:
        program = OrtProgram(folder / "model.pte", read_manifest(folder))
        cycle: list = [program]
        cycle.append(cycle)
        del program, cycle
        assert run_forked(_collect, "a collection in a forked child") is True
    finally:
        gc.enable()
        gc.collect()
