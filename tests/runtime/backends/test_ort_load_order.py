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


@pytest.fixture(scope="module")
def second_qnn_copy(tmp_path_factory):
    """A QAIRT-style SDK root holding a second copy of this environment's QNN libraries (as QAIRT's envsetup.sh points
    QNN_SDK_ROOT and LD_LIBRARY_PATH at an SDK's own): byte-identical files under another path."""
    import shutil

    from optimum_qnn.sdk.onnxruntime_ep import package_dir

    root = tmp_path_factory.mktemp("qairt")
    lib = root / "lib" / "x86_64-linux-clang"
    lib.mkdir(parents=True)
    package = package_dir()
    for folder in (package, package.parent / f"{package.name}.libs"):
        for path in folder.glob("*.so*"):
            shutil.copy2(path, lib / path.name)
    return root


@pytest.mark.parametrize("order", ["ort-first", "executorch-first"])
def test_a_second_copy_of_the_qnn_libraries_is_refused_not_an_abort(order, second_qnn_copy, demo_kv_export,
                                                                    run_python):
    """With QNN_SDK_ROOT at another copy of the libraries, the two runtimes would load two libQnnHtp.so: the process
    aborted (SIGABRT, "Fatal Python error: Aborted" under pytest). The second runtime now refuses, naming both copies
    and what to unset."""
    from tests.conftest import REPO_ROOT

    (folder,) = variant_dirs(demo_kv_export)  # the cheapest export with a kv_forward: the refusal comes before a run
    lib = second_qnn_copy / "lib" / "x86_64-linux-clang"
    env = {"QNN_SDK_ROOT": str(second_qnn_copy), "LD_LIBRARY_PATH": str(lib)}
    proc = run_python("-c", _SCRIPT.format(repo=str(REPO_ROOT), folder=str(folder), order=order), env=env, timeout=600)
    assert proc.returncode == 1, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    error = proc.stderr.strip().splitlines()[-1]
    assert "two copies of libQnnHtp.so in one process" in error and "unset QNN_SDK_ROOT" in error, error
    assert str(lib / "libQnnHtp.so") in error and "onnxruntime_qnn/libQnnHtp.so" in error, error
