"""Whether ExecuTorch's runtime in this process can run QNN delegates, and how to get one that can.

The QNN libraries are not enough: ExecuTorch's Python runtime must have been built with its QNN backend. The
registry's executorch 1.5.1 x86_64 Linux wheel has it (`QnnBackend`); its aarch64 Linux wheel links only XNNPACK
and OpenVINO, and there is no Windows on ARM wheel. On those hosts ExecuTorch has to be built from source with
`EXECUTORCH_BUILD_QNN=ON` (ExecuTorch's "Building from Source" guide: backends missing from the wheel are enabled
with `CMAKE_ARGS="-DEXECUTORCH_BUILD_<BACKEND>=ON" ./install_executorch.sh`), against a QAIRT SDK whose headers
the build needs (the registry's onnxruntime-qnn ships libraries only).
"""

from __future__ import annotations

from optimum_qnn.sdk.finding import QnnSdkError

QNN_BACKEND = "QnnBackend"
EXECUTORCH_VERSION = "1.5.1"
EXECUTORCH_QNN_BUILD = (
    f"git clone -b v{EXECUTORCH_VERSION} --depth 1 https://github.com/pytorch/executorch.git && cd executorch && "
    'CMAKE_ARGS="-DEXECUTORCH_BUILD_QNN=ON -DQNN_SDK_ROOT=/path/to/qairt/2.49.40" ./install_executorch.sh'
)


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported here, without importing it (a finder that refuses it counts as absent)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def executorch_backends() -> list[str] | None:
    """The backends ExecuTorch's runtime registers here (`registered_backends`), or None when ExecuTorch is not
    installed (the runtime install)."""
    return registered_backends() if is_installed("executorch") else None


class QnnBackendMissingError(QnnSdkError):
    """ExecuTorch's runtime in this process has no QNN backend: no QNN `.pte` can run here."""


def registered_backends() -> list[str]:
    """The backends ExecuTorch's runtime in this process has registered, e.g. `['QnnBackend', 'XnnpackBackend']`.

    Asked from executorch's pybindings (`portable_lib._get_registered_backend_names`); imports torch first.
    """
    import torch  # noqa: F401  (executorch's pybindings link against torch's libraries)
    from executorch.extension.pybindings import portable_lib

    return list(portable_lib._get_registered_backend_names())


def qnn_backend_fix(machine: str, system: str) -> str:
    """The one thing to do on this host to get an ExecuTorch runtime with the QNN backend."""
    if system.lower() == "linux" and machine.lower() in ("x86_64", "amd64"):
        return (
            f"reinstall the registry's wheel, which has it: pip install --force-reinstall --no-deps "
            f"executorch=={EXECUTORCH_VERSION}"
        )
    return (
        f"the registry's executorch {EXECUTORCH_VERSION} for {machine} {system} is built without the QNN backend; "
        f"build it from source with QNN (needs a QAIRT 2.49 SDK for its headers): {EXECUTORCH_QNN_BUILD}"
    )


def qnn_backend_missing_message(backends: list[str], machine: str, system: str) -> str:
    """Why no QNN `.pte` can run in this process, and the fix."""
    listed = ", ".join(backends) or "none"
    return (
        f"ExecuTorch's runtime in this Python has no QNN backend (registered backends: {listed}), so it cannot run "
        f"a QNN .pte. Fix: {qnn_backend_fix(machine, system)}"
    )


def check_qnn_backend() -> None:
    """Refuse, with the fix, when ExecuTorch's runtime here cannot run QNN delegates.

    Raises:
        QnnBackendMissingError: `QnnBackend` is not among the registered backends.
    """
    import platform

    backends = registered_backends()
    if QNN_BACKEND not in backends:
        raise QnnBackendMissingError(qnn_backend_missing_message(backends, platform.machine(), platform.system()))
