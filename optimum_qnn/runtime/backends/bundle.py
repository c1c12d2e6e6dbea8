"""What a phone needs to run one variant, found on this machine and checked before anything is pushed.

- ExecuTorch's ``qnn_llama_runner`` built for Android (``runner=``, ``--runner`` or ``$QNN_LLAMA_RUNNER``) and the
  ``libqnn_executorch_backend.so`` of the same build (beside the runner, or in its build tree);
- the QAIRT Android libraries for the variant's HTP arch, from the SDK ``$QNN_SDK_ROOT`` points at (the registry
  packages this project installs carry no Android libraries);
- the variant's ``model.pte`` and the artifact's tokenizer.

This is the list ExecuTorch's own host script (``SimpleADB`` in ``backends/qualcomm/export_utils.py``) pushes.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from optimum_qnn.runtime.backends.device import DeviceError
from optimum_qnn.sdk import SDK_ROOT_ENV, parse_build_id

RUNNER_ENV = "QNN_LLAMA_RUNNER"
RUNNER_NAME = "qnn_llama_runner"
BACKEND_LIBRARY = "libqnn_executorch_backend.so"
ANDROID_LIB_DIR = "lib/aarch64-android"
BUILD_HINT = (
    "Build ExecuTorch's qnn_llama_runner with tools/build_qnn_runner.sh, which runs ExecuTorch's "
    "backends/qualcomm/scripts/build.sh configuration (see docs/running.md, 'Run on a phone') and pass runner=PATH "
    f"(--runner PATH) or set {RUNNER_ENV}"
)
# Where ExecuTorch's CMake build puts the backend library, relative to a build folder (build-android/, build-x86/).
_BACKEND_IN_BUILD_TREE = ("backends/qualcomm", "lib", "lib/executorch/backends/qualcomm")


@dataclass(frozen=True)
class BundleFile:
    """One file to place on the phone: ``remote`` is relative to the phone workspace."""

    local: Path
    remote: str
    executable: bool = False
    sha256: str | None = None  # known in advance (the manifest's), else computed when needed


def find_runner(runner: str | os.PathLike | None = None) -> Path:
    """The runner executable: ``runner``, else ``$QNN_LLAMA_RUNNER``.

    Raises:
        DeviceError: neither is given, or the path is not a file.
    """
    source = "runner" if runner is not None else RUNNER_ENV
    value = runner if runner is not None else os.environ.get(RUNNER_ENV)
    if not value:
        raise DeviceError(f"No {RUNNER_NAME} given: running on a phone needs ExecuTorch's Qualcomm LLM runner. {BUILD_HINT}")
    path = Path(value).expanduser()
    if not path.is_file():
        raise DeviceError(f"The runner {path} (from {source}) does not exist. {BUILD_HINT}")
    return path.resolve()


def find_backend_library(runner: Path) -> Path:
    """``libqnn_executorch_backend.so`` of the runner's build: beside the runner, or in the build tree around it.

    Raises:
        DeviceError: naming the places looked at.
    """
    candidates = [runner.parent / BACKEND_LIBRARY]
    for ancestor in list(runner.parents)[:6]:  # build/examples/qualcomm/oss_scripts/llama/qnn_llama_runner -> build/
        candidates += [ancestor / sub / BACKEND_LIBRARY for sub in _BACKEND_IN_BUILD_TREE]
    for path in candidates:
        if path.is_file():
            return path
    raise DeviceError(
        f"No {BACKEND_LIBRARY} found beside the runner {runner} or in its build tree (looked in "
        f"{', '.join(str(p.parent) for p in candidates[:4])}, ...). Copy it from the same ExecuTorch build next to the "
        f"runner, or rebuild: {BUILD_HINT}"
    )


def android_library_names(htp_arch: int) -> tuple[str, ...]:
    """QAIRT files for HTP arch ``v<htp_arch>``, relative to the SDK root, in the order ExecuTorch pushes them."""
    return (
        f"{ANDROID_LIB_DIR}/libQnnHtp.so",
        f"{ANDROID_LIB_DIR}/libQnnHtpV{htp_arch}Stub.so",
        f"{ANDROID_LIB_DIR}/libQnnHtpPrepare.so",
        f"{ANDROID_LIB_DIR}/libQnnSystem.so",
        f"lib/hexagon-v{htp_arch}/unsigned/libQnnHtpV{htp_arch}Skel.so",
    )


def sdk_root(explicit: str | os.PathLike | None = None) -> Path:
    """The QAIRT SDK holding the Android libraries: ``explicit``, else ``$QNN_SDK_ROOT``."""
    value = explicit if explicit is not None else os.environ.get(SDK_ROOT_ENV)
    if not value:
        raise DeviceError(
            f"{SDK_ROOT_ENV} is not set: the phone needs QAIRT's Android libraries ({ANDROID_LIB_DIR}/libQnnHtp.so ...), "
            f"which only Qualcomm's QAIRT SDK ships. Download it, then set {SDK_ROOT_ENV} to its top folder"
        )
    return Path(value).expanduser().absolute()


def android_libraries(root: Path, htp_arch: int) -> list[Path]:
    """The QAIRT Android libraries of one HTP arch under an SDK root, all checked to exist.

    Raises:
        DeviceError: listing the missing files.
    """
    paths = [root / name for name in android_library_names(htp_arch)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DeviceError(
            f"{SDK_ROOT_ENV}={root} lacks the QAIRT Android libraries for HTP v{htp_arch}: {', '.join(missing)}. "
            f"Set {SDK_ROOT_ENV} to a QAIRT SDK (the folder holding lib/aarch64-android and lib/hexagon-v{htp_arch}); "
            "the onnxruntime-qnn / qnnruntime packages carry no Android libraries"
        )
    return paths


def library_build_id(library: Path) -> str:
    """The QAIRT build id written in a QNN library (read from its bytes: an Android library cannot be loaded here).

    Raises:
        DeviceError: when the file holds no build id.
    """
    with open(library, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            build_id = None
        else:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                build_id = parse_build_id(data)
    if build_id is None:
        raise DeviceError(f"No QAIRT build id found in {library}; is it a QAIRT library? Check {SDK_ROOT_ENV}")
    return build_id
