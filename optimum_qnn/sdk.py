"""Find the QNN runtime libraries and make ExecuTorch's Qualcomm backend usable, with no download.

ExecuTorch's Qualcomm code expects a QAIRT SDK laid out as `$QNN_SDK_ROOT/lib/<host>/libQnnHtp.so` and, when
`QNN_SDK_ROOT` is unset, tries to download one from Qualcomm (which fails without that network). Two sources
are supported instead:

1. a real SDK the user points `QNN_SDK_ROOT` at (validated, never modified);
2. the x86_64 libraries shipped by the registry package `onnxruntime-qnn==2.5.0` (QAIRT 2.49.40): a small cache
   folder whose `lib/x86_64-linux-clang` is a symlink to the installed package folder becomes `QNN_SDK_ROOT`.

Importing this module is cheap: torch and executorch load inside `ensure_qnn_sdk()` only.

Example:
    >>> from optimum_qnn.sdk import ensure_qnn_sdk
    >>> sdk = ensure_qnn_sdk()  # before anything lowers to or runs on QNN
    >>> sdk.build_id
    'v2.49.40.260810104044'
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import logging
import os
import platform
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from optimum_qnn.config import Soc
from optimum_qnn.errors import OptimumQnnError

logger = logging.getLogger(__name__)

ORT_QNN_DIST = "onnxruntime-qnn"
ORT_QNN_PACKAGE = "onnxruntime_qnn"
# Exact pin: 2.3.0, 2.4.0, 2.6.0 and 2.7.0 ship QNN libraries whose device-config struct layout differs from
# the one executorch 1.5.1 was built against; device creation fails with the error quoted below.
REQUIRED_ORT_QNN_VERSION = "2.5.0"
_ORT_QNN_MISMATCH_ERROR = "unknown custom config socModel 0"

SDK_ROOT_ENV = "QNN_SDK_ROOT"
CACHE_ENV = "OPTIMUM_QNN_CACHE"
SOURCE_USER_SDK = "QNN_SDK_ROOT"
SOURCE_ORT_QNN = f"{ORT_QNN_DIST}=={REQUIRED_ORT_QNN_VERSION}"

HTP_LIBRARY = "libQnnHtp.so"
SYSTEM_LIBRARY = "libQnnSystem.so"
REQUIRED_LIBRARIES = (HTP_LIBRARY, SYSTEM_LIBRARY)

# QAIRT build ids look like `v2.49.40.260810104044` (major.minor.patch.timestamp).
_BUILD_ID_RE = re.compile(rb"v2\.\d{1,3}\.\d{1,3}\.\d{6,}")


class QnnSdkError(OptimumQnnError, RuntimeError):
    """The QNN libraries cannot be found or used; the message says what was expected where."""


@dataclass(frozen=True)
class QnnSdk:
    """Where the QNN libraries of this process come from.

    Args:
        root: the folder `QNN_SDK_ROOT` points at.
        lib_dir: the host library folder inside `root` (e.g. `lib/x86_64-linux-clang`).
        source: `"QNN_SDK_ROOT"` for a user SDK, `"onnxruntime-qnn==2.5.0"` for the registry libraries.
        build_id: the QAIRT build id read from the HTP library, e.g. `v2.49.40.260810104044`.
        htp_library: path of `libQnnHtp.so` (the HTP backend; on x86 it also holds the HTP emulator).
    """

    root: Path
    lib_dir: Path
    source: str
    build_id: str
    htp_library: Path

    @property
    def qairt_version(self) -> str:
        """`major.minor.patch` of the build id, e.g. `2.49.40`."""
        return ".".join(self.build_id.lstrip("v").split(".")[:3])


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers (unit-tested without touching the process)
# ---------------------------------------------------------------------------------------------------------------


def host_lib_dir_patterns(machine: str, system: str = "Linux") -> tuple[str, ...]:
    """Glob patterns, relative to `$QNN_SDK_ROOT/lib`, of the library folder for a host.

    Args:
        machine: `platform.machine()` of the host, e.g. `x86_64` or `aarch64`.
        system: `platform.system()` of the host; only Linux is supported.

    Returns:
        Patterns in order of preference, e.g. `("x86_64-linux-clang",)` or `("aarch64-oe-linux-gcc*",)`
        (QAIRT names its aarch64 Linux folders after the toolchain: `aarch64-oe-linux-gcc11.2`, `...gcc9.3`).

    Raises:
        QnnSdkError: for a host QAIRT publishes no Linux libraries for.
    """
    if system.lower() != "linux":
        raise QnnSdkError(f"QNN host libraries are supported on Linux only; this host runs {system}")
    machine = machine.lower()
    if machine in ("x86_64", "amd64"):
        return ("x86_64-linux-clang",)
    if machine in ("aarch64", "arm64"):
        return ("aarch64-oe-linux-gcc*",)
    raise QnnSdkError(f"No QNN host libraries exist for machine {machine!r}; expected one of: x86_64, aarch64")


def _toolchain_version(folder: Path) -> tuple[int, ...]:
    """`aarch64-oe-linux-gcc11.2` -> (11, 2), so the newest toolchain sorts last."""
    return tuple(int(n) for n in re.findall(r"\d+", folder.name.rsplit("gcc", 1)[-1]))


def find_host_lib_dir(root: Path, machine: str | None = None, system: str | None = None) -> Path:
    """The host library folder of an SDK at `root`, checked to hold the libraries executorch loads.

    Args:
        root: the SDK folder (what `QNN_SDK_ROOT` points at).
        machine: host machine; defaults to `platform.machine()`.
        system: host OS; defaults to `platform.system()`.

    Returns:
        The library folder, e.g. `root/lib/x86_64-linux-clang`.

    Raises:
        QnnSdkError: naming the folder and the files that were expected there.
    """
    machine = machine or platform.machine()
    system = system or platform.system()
    patterns = host_lib_dir_patterns(machine, system)
    expected = " or ".join(f"{root}/lib/{p}/{{{','.join(REQUIRED_LIBRARIES)}}}" for p in patterns)
    if not root.is_dir():
        raise QnnSdkError(f"{SDK_ROOT_ENV}={root} is not a folder; expected a QAIRT SDK holding {expected}")
    candidates = sorted(
        (d for p in patterns for d in (root / "lib").glob(p) if d.is_dir()), key=_toolchain_version, reverse=True
    )
    for lib_dir in candidates:
        if all((lib_dir / name).is_file() for name in REQUIRED_LIBRARIES):
            return lib_dir
    found = ", ".join(str(d) for d in candidates) or "no such folder"
    raise QnnSdkError(
        f"{SDK_ROOT_ENV}={root} does not look like a QAIRT SDK for this {machine} host: expected {expected} "
        f"(found: {found}). Point {SDK_ROOT_ENV} at the SDK's top folder (the one holding lib/ and include/), "
        f"or unset it to use the libraries of {SOURCE_ORT_QNN}."
    )


def check_onnxruntime_qnn_version(found: str) -> None:
    """Refuse any onnxruntime-qnn release other than the one executorch 1.5.1 can drive.

    Raises:
        QnnSdkError: with the found version, the failure it would cause and the fix.
    """
    if found != REQUIRED_ORT_QNN_VERSION:
        raise QnnSdkError(
            f"{ORT_QNN_DIST}=={REQUIRED_ORT_QNN_VERSION} is required; found {found}, whose QNN libraries "
            f"executorch 1.5.1 cannot configure (fails with '{_ORT_QNN_MISMATCH_ERROR}'). "
            f"Fix: pip install {ORT_QNN_DIST}=={REQUIRED_ORT_QNN_VERSION}"
        )


def parse_build_id(data: bytes) -> str | None:
    """The first QAIRT build id (`v2.NN.NN.NNNNNN...`) in a library's bytes, or None."""
    match = _BUILD_ID_RE.search(data)
    return match.group().decode() if match else None


# ---------------------------------------------------------------------------------------------------------------
# Process set-up
# ---------------------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_sdk: QnnSdk | None = None


def ensure_qnn_sdk() -> QnnSdk:
    """Make ExecuTorch's Qualcomm backend usable in this process and say where its libraries come from.

    Call it before anything lowers to or runs on QNN (executorch reads `QNN_SDK_ROOT` when a backend starts and
    downloads an SDK when it is unset). Idempotent and thread-safe: later calls return the cached result.

    Effects on the process: sets `QNN_SDK_ROOT` (registry libraries only), appends the library folder to
    `LD_LIBRARY_PATH` (seen by child processes, not by this one's loader), imports torch, then loads
    `libQnnHtp.so` and `libQnnSystem.so` globally so executorch's `dlopen("libQnnHtp.so")` finds them by name.

    Returns:
        The `QnnSdk` in use.

    Raises:
        QnnSdkError: a `QNN_SDK_ROOT` with the wrong layout, no or the wrong onnxruntime-qnn, or a library that
            fails to load.
    """
    global _sdk
    if _sdk is not None:
        return _sdk
    with _lock:
        if _sdk is None:
            _sdk = _set_up()
            logger.info("QNN libraries: %s (%s), build %s", _sdk.lib_dir, _sdk.source, _sdk.build_id)
    return _sdk


def _set_up() -> QnnSdk:
    user_root = os.environ.get(SDK_ROOT_ENV)
    ort_dir = _find_ort_qnn_dir()
    if user_root:
        root = Path(user_root).expanduser().absolute()
        lib_dir = find_host_lib_dir(root)
        # A QNN_SDK_ROOT inherited from a parent process that set it up from onnxruntime-qnn is still the
        # registry libraries: label (and version-check) it as such.
        if ort_dir is not None and lib_dir.resolve() == ort_dir.resolve():
            check_onnxruntime_qnn_version(importlib.metadata.version(ORT_QNN_DIST))
            source = SOURCE_ORT_QNN
        else:
            source = SOURCE_USER_SDK
    else:
        if ort_dir is None:
            raise QnnSdkError(
                f"No QNN libraries found: {SDK_ROOT_ENV} is unset and {ORT_QNN_DIST} is not installed. "
                f"Fix: pip install {ORT_QNN_DIST}=={REQUIRED_ORT_QNN_VERSION}, or set {SDK_ROOT_ENV} to a QAIRT SDK."
            )
        check_onnxruntime_qnn_version(importlib.metadata.version(ORT_QNN_DIST))
        # The registry wheel only ships x86_64 Linux libraries.
        if host_lib_dir_patterns(platform.machine(), platform.system()) != ("x86_64-linux-clang",):
            raise QnnSdkError(
                f"{ORT_QNN_DIST} provides x86_64 Linux libraries only; on this {platform.machine()} host set "
                f"{SDK_ROOT_ENV} to a QAIRT SDK"
            )
        for name in REQUIRED_LIBRARIES:
            if not (ort_dir / name).is_file():
                raise QnnSdkError(f"{ort_dir} lacks {name}: reinstall with pip install --force-reinstall {SOURCE_ORT_QNN}")
        root = _link_cache_root(ort_dir, REQUIRED_ORT_QNN_VERSION)
        lib_dir = root / "lib" / "x86_64-linux-clang"
        source = SOURCE_ORT_QNN
        os.environ[SDK_ROOT_ENV] = str(root)

    _append_ld_library_path(lib_dir)
    _load_globally(lib_dir)
    htp_library = lib_dir / HTP_LIBRARY
    return QnnSdk(root=root, lib_dir=lib_dir, source=source, build_id=read_build_id(htp_library), htp_library=htp_library)


def _find_ort_qnn_dir() -> Path | None:
    """The installed `onnxruntime_qnn/` folder, found without importing it (its `__init__` loads onnxruntime)."""
    spec = importlib.util.find_spec(ORT_QNN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _cache_home() -> Path:
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "optimum-qnn"


def _link_cache_root(lib_source: Path, version: str) -> Path:
    """`<cache>/qnn-sdk/<version>/` with `lib/x86_64-linux-clang` -> `lib_source`; returns the root.

    The link is created under a unique temporary name and renamed over the final one, so concurrent processes
    (pytest-xdist, two exports) never see a missing or half-made link. An existing link to another folder (an
    older venv) is replaced the same way.
    """
    root = _cache_home() / "qnn-sdk" / version
    link = root / "lib" / "x86_64-linux-clang"
    target = lib_source.resolve()
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return root
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists() and not link.is_symlink():
        raise QnnSdkError(f"{link} exists and is not a symlink; remove it (it is a cache made by optimum-qnn)")
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex}")
    os.symlink(target, tmp, target_is_directory=True)
    os.replace(tmp, link)
    return root


def _append_ld_library_path(lib_dir: Path) -> None:
    # The dynamic loader reads LD_LIBRARY_PATH at process start, so this only helps child processes
    # (runners, subprocess tests); this process relies on the global loads below.
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if str(lib_dir) not in parts:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([*parts, str(lib_dir)])


def _load_globally(lib_dir: Path) -> None:
    """Load the HTP and System libraries with RTLD_GLOBAL so `dlopen` by bare name finds them later.

    torch must be imported first: loading libQnnHtp.so before it crashes the process (`libc++abi: Pure virtual
    function called!` or a segfault), as both bring their own C++ runtime. libHtpPrepare.so is never loaded:
    next to libQnnHtp.so it aborts with `duplicate op key @BlockZap`.
    """
    import torch  # noqa: F401  (import order matters, see above)

    for name in (HTP_LIBRARY, SYSTEM_LIBRARY):
        try:
            ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            raise QnnSdkError(f"Cannot load {lib_dir / name}: {error}") from error


def read_build_id(htp_library: Path) -> str:
    """The QAIRT build id of an HTP library, e.g. `v2.49.40.260810104044`.

    Asked from the library itself through executorch's `PyQnnManagerAdaptor.GetQnnSdkBuildId` (the QNN API's
    own answer). That call aborts the whole process on a library it cannot load, so it runs only after the
    library was loaded here and exports the QNN entry point; otherwise the id is read from the bytes.

    Raises:
        QnnSdkError: when no build id can be found.
    """
    import torch  # noqa: F401  (must precede loading any QNN library, see `_load_globally`)

    if _exports_qnn_interface(htp_library):
        from executorch.backends.qualcomm.python import PyQnnManagerAdaptor

        build_id = PyQnnManagerAdaptor.GetQnnSdkBuildId(str(htp_library))
        if build_id:
            return build_id
    build_id = parse_build_id(htp_library.read_bytes())
    if build_id is None:
        raise QnnSdkError(f"No QNN build id found in {htp_library}; is it a QAIRT HTP backend library?")
    return build_id


def _exports_qnn_interface(library: Path) -> bool:
    try:
        return hasattr(ctypes.CDLL(str(library)), "QnnInterface_getProviders")
    except OSError:
        return False


def supported_socs() -> tuple[Soc, ...]:
    """The SoCs this installation can target: those executorch's `QcomChipset` knows with the same HTP arch.

    Reads executorch's Qualcomm schema (plain dataclasses; no SDK needed).
    """
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset, _soc_info_table

    socs = []
    for soc in Soc:
        chipset = QcomChipset.__members__.get(soc.name)
        if chipset is not None and int(_soc_info_table[chipset].htp_info.htp_arch) == soc.htp_arch:
            socs.append(soc)
    return tuple(socs)
