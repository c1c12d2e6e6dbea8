"""onnxruntime-qnn in this process: the QNN execution provider registered once, and QNN libraries loaded safely.

Three measured hazards shape this module (x86_64 Linux, onnxruntime 1.32 / onnxruntime-qnn 2.5.0, torch 2.13):

1. **A QNN library loaded before torch breaks C++ exceptions for the rest of the process.** The QNN libraries
   bring a private `libunwind` (`onnxruntime_qnn.libs/libunwind-*.so`). When the system `libgcc_s.so.1` is first
   loaded as a dependency of those libraries, its unwinder binds its `_Unwind_GetCFA` calls into that private
   `libunwind`; the first exception torch throws afterwards (importing executorch does) segfaults inside
   `unw_get_reg`. Loading `libgcc_s.so.1` globally *before* any QNN library binds it to itself, and the crash is
   gone (`protect_unwinder`). This is what lets this backend load QNN without importing torch.
2. **onnxruntime loaded after the QNN libraries went global segfaults.** `ensure_qnn_sdk` (the ExecuTorch
   backend's set-up) loads `libQnnHtp.so` with RTLD_GLOBAL, which puts its private `libc++abi` in the global
   scope; onnxruntime's Python module, loaded afterwards, binds `__gxx_personality_v0` to it and its first
   (libstdc++) exception crashes in `_Unwind_GetLanguageSpecificData`. So `ensure_qnn_sdk` calls
   `bind_onnxruntime_first` before its global loads: onnxruntime and the QNN EP library bind to libstdc++ while the
   global scope is still clean (0.2 s, only when onnxruntime-qnn is installed).
3. **The QNN execution provider is registered once per process**: a second `register_execution_provider_library`
   with the same name fails, and every session draws its devices from that one registration.
4. **Two copies of the HTP library in one process abort it.** A QAIRT shell (QAIRT's `envsetup.sh`) sets
   `QNN_SDK_ROOT` to the SDK's own libraries; ExecuTorch's backend then loads that `libQnnHtp.so`, while the QNN EP
   loads the one of its package. Measured (two byte-identical copies of the onnxruntime-qnn 2.5.0 libraries): the
   second copy's first session or device aborts the whole process (SIGABRT, no message), whichever runtime came
   first. `check_single_htp_library` refuses the second load, naming both copies (a second copy on
   `LD_LIBRARY_PATH` alone is harmless: both runtimes load their library by its path).

Nothing here imports torch or executorch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading
from pathlib import Path
from typing import Any

from optimum_qnn.errors import OptimumQnnError

EP_NAME = "QNNExecutionProvider"

_lock = threading.Lock()
_protected = False
_devices: list | None = None


class OrtBackendError(OptimumQnnError):
    """The onnxruntime backend cannot load or run a program; the message says why and what to do."""


def bind_onnxruntime_first() -> None:
    """Load onnxruntime and register the QNN EP now, if they are installed (hazard 2): called by `ensure_qnn_sdk`
    before it loads the QNN libraries globally, so the onnxruntime backend can still load later in the process."""
    try:
        import onnxruntime  # noqa: F401
        import onnxruntime_qnn  # noqa: F401
    except ImportError:
        return
    qnn_ep_devices()


def protect_unwinder() -> None:
    """Load the system `libgcc_s` globally before any QNN library (see the module docstring, hazard 1).

    Idempotent; a no-op off Linux (Windows and macOS have no `libgcc_s` in this role).
    """
    global _protected
    if _protected or platform.system() != "Linux":
        _protected = True
        return
    name = ctypes.util.find_library("gcc_s") or "libgcc_s.so.1"
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:  # a static-libgcc system: nothing to protect
        pass
    _protected = True


def package_dir() -> Path:
    """The installed `onnxruntime_qnn` folder (the QNN EP and the QNN libraries of QAIRT 2.49.40)."""
    try:
        import onnxruntime_qnn
    except ImportError:
        raise OrtBackendError(
            "The onnxruntime backend needs onnxruntime-qnn: pip install onnxruntime-qnn==2.5.0"
        ) from None
    return Path(onnxruntime_qnn.get_library_path()).parent


def htp_backend_path() -> Path:
    import onnxruntime_qnn

    return Path(onnxruntime_qnn.get_qnn_htp_path())


def qnn_ep_devices() -> list[Any]:
    """The QNN EP's devices, registering the EP library on first use (once per process, thread-safe)."""
    global _devices
    if _devices is not None:
        return _devices
    with _lock:
        if _devices is None:
            package_dir()
            import onnxruntime
            import onnxruntime_qnn

            if not any(d.ep_name == EP_NAME for d in onnxruntime.get_ep_devices()):
                onnxruntime.register_execution_provider_library(EP_NAME, onnxruntime_qnn.get_library_path())
            devices = [d for d in onnxruntime.get_ep_devices() if d.ep_name == EP_NAME]
            if not devices:
                raise OrtBackendError(
                    f"onnxruntime registered {onnxruntime_qnn.get_library_path()} but offers no {EP_NAME} device"
                )
            _devices = devices
    return _devices


HTP_LIBRARY = "libQnnHtp.so"


def loaded_htp_libraries() -> list[Path]:
    """The HTP backend libraries (`libQnnHtp.so`) mapped into this process, read from `/proc/self/maps`; empty where
    there is no such file (off Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found: dict[str, Path] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rsplit("/", 1)[-1] == HTP_LIBRARY:
            found.setdefault(fields[5], Path(fields[5]))
    return list(found.values())


def check_single_htp_library(wanted: Path, wanted_by: str, error: type[Exception]) -> None:
    """Raise ``error`` if this process already holds a `libQnnHtp.so` that is not the file ``wanted`` (hazard 4).

    Args:
        wanted: the HTP library about to be loaded.
        wanted_by: who loads it, for the message (e.g. ``"onnxruntime-qnn"``).
        error: the exception type to raise (the caller's own error type).
    """
    for loaded in loaded_htp_libraries():
        try:
            same = os.path.samefile(loaded, wanted)
        except OSError:  # a library deleted since it was loaded: surely not the file wanted now
            same = False
        if not same:
            root = os.environ.get("QNN_SDK_ROOT")
            raise error(
                f"This process already runs QNN from {loaded}, and {wanted_by} would load a second copy, {wanted}: "
                "two copies of libQnnHtp.so in one process abort it. This happens in a shell where QAIRT's envsetup.sh "
                f"set QNN_SDK_ROOT (now {root!r}) to libraries other than onnxruntime-qnn's: unset QNN_SDK_ROOT "
                "(`unset QNN_SDK_ROOT`) to use onnxruntime-qnn's libraries for both, or run each runtime in a process "
                "of its own (e.g. `python -m optimum_qnn run FOLDER --device host:onnxruntime`)"
            )
