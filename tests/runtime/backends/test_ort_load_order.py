"""ExecuTorch's backend and the onnxruntime backend in one process, loaded in either order (each order in a fresh
interpreter: what a process loaded first is the point). Both orders segfaulted before `sdk.onnxruntime_ep`."""

from __future__ import annotations

import pytest

from tests.runtime.backends.ort_helpers import variant_dirs

_SCRIPT = """
import sys
from pathlib import Path
import numpy as np
from optimum_qnn.artifacts.manifest import read_manifest
sys.path.insert(0, {repo!r})
from tests.runtime.backends.ort_helpers import contract_inputs, executorch_outputs, same_bytes

folder = Path({folder!r})
manifest = read_manifest(folder)
inputs = contract_inputs(manifest, "kv_forward", 7)

def ort():
    from optimum_qnn.runtime.backends.onnxruntime import OrtProgram
    return OrtProgram(folder / "model.pte", manifest).methods["kv_forward"](inputs)

def et():
    from optimum_qnn.sdk import ensure_qnn_sdk
    ensure_qnn_sdk()
    return executorch_outputs(folder, "kv_forward", inputs)

if {order!r} == "ort-first":
    first = ort()
    print("torch loaded by the onnxruntime backend:", "torch" in sys.modules, "executorch" in sys.modules, flush=True)
    second = et()
else:
    first = et()
    second = ort()
print("IDENTICAL" if all(same_bytes(a, b) for a, b in zip(first, second)) else "DIFFERENT", flush=True)
"""


@pytest.mark.parametrize("order", ["ort-first", "executorch-first"])
def test_both_backends_in_one_process(order, a16w8_export, run_python):
    from tests.conftest import REPO_ROOT

    (folder,) = variant_dirs(a16w8_export("hybrid"))
    proc = run_python("-c", _SCRIPT.format(repo=str(REPO_ROOT), folder=str(folder), order=order), timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert "IDENTICAL" in proc.stdout, proc.stdout
    if order == "ort-first":
        assert "torch loaded by the onnxruntime backend: False False" in proc.stdout, proc.stdout
