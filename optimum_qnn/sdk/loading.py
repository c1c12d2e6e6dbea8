"""Set the QNN libraries up in this process, so ExecuTorch's Qualcomm backend runs without any download.

ExecuTorch's Qualcomm code expects a QAIRT SDK laid out as `$QNN_SDK_ROOT/lib/<host>/libQnnHtp.so` and, when
`QNN_SDK_ROOT` is unset, tries to download one from Qualcomm (which fails without that network). Instead:

1. a real SDK the user points `QNN_SDK_ROOT` at is validated and used as is;
2. otherwise the libraries of `onnxruntime-qnn==2.5.0` (QAIRT 2.49.40): on Linux a small cache folder
   `<cache>/qnn-sdk/2.5.0-<key>/` whose `lib/<host dir>` is a symlink to the installed package folder becomes
   `QNN_SDK_ROOT` (the key names that folder: each environment has its own root, and no process re-points a link
   another environment's process uses; roots whose package folder is gone are removed); on aarch64 Linux that folder (which holds the Hexagon skels) goes first in `ADSP_LIBRARY_PATH`;
   on Windows on Snapdragon the package folder is added to the DLL search path (the skels beside `QnnHtp.dll`
   are found there; Windows symlinks need privileges, and no ExecuTorch wheel reads `QNN_SDK_ROOT` there).

Importing this module is cheap: torch and executorch load inside `ensure_qnn_sdk()` only.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from optimum_qnn.config import Soc
from optimum_qnn.sdk.finding import (
    SDK_ROOT_ENV,
    SOURCE_USER_SDK,
    X86_64_HOST_DIR,
    Host,
    QnnSdkError,
    RegistryLibraries,
    adsp_library_path,
    find_host_lib_dir,
    find_package_dir,
    find_skel_dirs,
    host_for,
    registry_libraries,
    ORT_QNN_PACKAGE,
)
from optimum_qnn.sdk.versions import parse_build_id

logger = logging.getLogger(__name__)

CACHE_ENV = "OPTIMUM_QNN_CACHE"
# Where FastRPC looks for the DSP-side (skel) libraries; a `;`-separated list.
ADSP_LIBRARY_PATH_ENV = "ADSP_LIBRARY_PATH"


@dataclass(frozen=True)
class QnnSdk:
    """Where the QNN libraries of this process come from.

    Args:
        root: the folder `QNN_SDK_ROOT` points at (on Windows with the registry package: the package folder).
        lib_dir: the host library folder inside `root` (e.g. `lib/x86_64-linux-clang`).
        source: `"QNN_SDK_ROOT"` for a user SDK, else the registry package, `"onnxruntime-qnn==2.5.0"`.
        build_id: the QAIRT build id read from the HTP library, e.g. `v2.49.40.260810104044`.
        htp_library: path of the HTP backend library (on x86 it also holds the HTP emulator).
        skel_dirs: the Hexagon skel folders by HTP arch (empty on x86_64).
    """

    root: Path
    lib_dir: Path
    source: str
    build_id: str
    htp_library: Path
    skel_dirs: Mapping[int, Path] = field(default_factory=dict)

    @property
    def qairt_version(self) -> str:
        """`major.minor.patch` of the build id, e.g. `2.49.40`."""
        return ".".join(self.build_id.lstrip("v").split(".")[:3])


_lock = threading.Lock()
_sdk: QnnSdk | None = None


def ensure_qnn_sdk() -> QnnSdk:
    """Make ExecuTorch's Qualcomm backend usable in this process and say where its libraries come from.

    Call it before anything lowers to or runs on QNN (executorch reads `QNN_SDK_ROOT` when a backend starts and
    downloads an SDK when it is unset). Idempotent and thread-safe: later calls return the cached result.

    Effects on the process: sets `QNN_SDK_ROOT` (registry libraries, Linux), puts the Hexagon skel folder first in
    `ADSP_LIBRARY_PATH` (aarch64 Linux), appends the library folder to `LD_LIBRARY_PATH` (seen by child
    processes, not by this one's loader), imports torch, then loads the HTP and System libraries globally so
    executorch's `dlopen("libQnnHtp.so")` finds them by name.

    Raises:
        QnnSdkError: a `QNN_SDK_ROOT` with the wrong layout, onnxruntime-qnn missing or of the wrong version, a
            host no wheel covers, or a library that fails to load.
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
    machine, system = platform.machine(), platform.system()
    host = host_for(machine, system)
    user_root = os.environ.get(SDK_ROOT_ENV)
    registry: RegistryLibraries | None = None
    skel_dirs: dict[int, Path] = {}
    if user_root:
        root = Path(user_root).expanduser().absolute()
        lib_dir = find_host_lib_dir(root, machine, system)
        # A QNN_SDK_ROOT inherited from a parent process that set it up from the registry package is still the
        # registry libraries: label (and check) them as such.
        if _is_registry_lib_dir(lib_dir):
            registry = registry_libraries(machine, system)
            source = registry.source
        else:
            source = SOURCE_USER_SDK
            if host.skels != "none":
                skel_dirs = find_skel_dirs(root / "lib") or find_skel_dirs(lib_dir)
    else:
        registry = registry_libraries(machine, system)
        source = registry.source
        if host.skels == "beside_library":
            root = lib_dir = registry.lib_source
        else:
            root = _link_cache_root(registry.lib_source, registry.cache_name, registry.host_dir)
            lib_dir = root / "lib" / registry.host_dir
            os.environ[SDK_ROOT_ENV] = str(root)
    if registry is not None:
        skel_dirs = dict(registry.skel_dirs)

    if host.skels == "adsp_library_path" and skel_dirs:
        os.environ[ADSP_LIBRARY_PATH_ENV] = adsp_library_path(
            os.environ.get(ADSP_LIBRARY_PATH_ENV), (d.resolve() for d in skel_dirs.values())
        )
    _add_library_path(lib_dir, host)
    _load_globally(lib_dir, host)
    htp_library = lib_dir / host.htp_library
    return QnnSdk(
        root=root, lib_dir=lib_dir, source=source, build_id=read_build_id(htp_library), htp_library=htp_library,
        skel_dirs=skel_dirs,
    )


def _is_registry_lib_dir(lib_dir: Path) -> bool:
    """Whether `lib_dir` is (a link to) the installed onnxruntime-qnn package folder."""
    folder = find_package_dir(ORT_QNN_PACKAGE)
    return folder is not None and folder.exists() and lib_dir.resolve() == folder.resolve()


def _find_ort_qnn_dir() -> Path | None:
    """The installed `onnxruntime_qnn/` folder."""
    return find_package_dir(ORT_QNN_PACKAGE)


def cache_home() -> Path:
    """optimum-qnn's per-user cache: ``$OPTIMUM_QNN_CACHE`` or ``~/.cache/optimum-qnn``."""
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "optimum-qnn"


def _link_cache_root(lib_source: Path, name: str, host_dir: str = X86_64_HOST_DIR) -> Path:
    """`<cache>/qnn-sdk/<name>/` with `lib/<host_dir>` -> `lib_source`; returns the root.

    ``name`` is keyed by the package folder (`finding.cache_name`), so the link is made once and never re-pointed:
    a process of another environment has a root of its own. The link is created under a unique temporary name and
    renamed into place, so concurrent processes never see a missing or half-made link. A link whose target is
    gone (a deleted environment) is replaced, here and, for other roots, removed (`_prune_stale_roots`).
    """
    base = cache_home() / "qnn-sdk"
    root = base / name
    link = root / "lib" / host_dir
    target = lib_source.resolve()
    _prune_stale_roots(base, keep=root)
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return root
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.exists():
        raise QnnSdkError(
            f"{link} points at {os.readlink(link)}, not at this environment's {target}; remove {root} "
            "(a cache made by optimum-qnn) and retry"
        )
    if link.exists() and not link.is_symlink():
        raise QnnSdkError(f"{link} exists and is not a symlink; remove it (it is a cache made by optimum-qnn)")
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex}")
    os.symlink(target, tmp, target_is_directory=True)
    os.replace(tmp, link)
    return root


def _prune_stale_roots(base: Path, keep: Path) -> None:
    """Remove the cache roots under ``base`` whose every library link points at a folder that no longer exists
    (an environment that was deleted). Races with another process pruning the same root are harmless."""
    if not base.is_dir():
        return
    for root in base.iterdir():
        lib = root / "lib"
        if root == keep or not lib.is_dir():
            continue
        links = list(lib.iterdir())
        if not links or not all(p.is_symlink() and not p.exists() for p in links):
            continue
        for p in links:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        with contextlib.suppress(OSError):
            lib.rmdir()
            root.rmdir()
        logger.info("Removed %s: its QNN libraries' folder is gone", root)


def _add_library_path(lib_dir: Path, host: Host) -> None:
    if host.skels == "beside_library":
        # Windows: dependent DLLs of QnnHtp.dll (its stubs) are searched in the added folders.
        os.add_dll_directory(str(lib_dir))  # type: ignore[attr-defined]  (Windows only)
        return
    # The dynamic loader reads LD_LIBRARY_PATH at process start, so this only helps child processes
    # (runners, subprocess tests); this process relies on the global loads below.
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if str(lib_dir) not in parts:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([*parts, str(lib_dir)])


def _import_torch_if_installed() -> None:
    """torch first, where it is installed (see `_load_globally`); the runtime install has none, and then nothing
    can load it after the QNN libraries (the unwinder hazard of the other order is `protect_unwinder`'s)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def _load_globally(lib_dir: Path, host: Host) -> None:
    """Load the HTP and System libraries with RTLD_GLOBAL so `dlopen` by bare name finds them later.

    torch must be imported first: loading libQnnHtp.so before it crashes the process (`libc++abi: Pure virtual
    function called!` or a segfault), as both bring their own C++ runtime. The HTP prepare library
    (`libHtpPrepare.so` / `libQnnHtpPrepare.so`) is never loaded: next to libQnnHtp.so it aborts with
    `duplicate op key @BlockZap`.
    """
    _import_torch_if_installed()  # import order matters, see above
    from optimum_qnn.sdk.onnxruntime_ep import bind_onnxruntime_first, check_single_htp_library

    bind_onnxruntime_first()  # onnxruntime loaded after the global loads below would crash (see that module)
    # onnxruntime-qnn may already run its own copy of the HTP library here: a second one aborts the process.
    check_single_htp_library(lib_dir / host.htp_library, "ExecuTorch's QNN backend", QnnSdkError)
    for name in host.libraries:
        try:
            ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            raise QnnSdkError(f"Cannot load {lib_dir / name}: {error}") from error


def read_build_id(htp_library: Path) -> str:
    """The QAIRT build id of an HTP library, e.g. `v2.49.40.260810104044`.

    Asked from the library itself through executorch's `PyQnnManagerAdaptor.GetQnnSdkBuildId` (the QNN API's
    own answer) where that module exists (not in executorch's aarch64 wheel). That call aborts the whole process
    on a library it cannot load, so it runs only after the library was loaded here and exports the QNN entry
    point; otherwise the id is read from the bytes.

    Raises:
        QnnSdkError: when no build id can be found.
    """
    _import_torch_if_installed()  # must precede loading any QNN library, see `_load_globally`
    if _exports_qnn_interface(htp_library):
        try:
            from executorch.backends.qualcomm.python import PyQnnManagerAdaptor
        except ImportError:
            PyQnnManagerAdaptor = None
        build_id = PyQnnManagerAdaptor.GetQnnSdkBuildId(str(htp_library)) if PyQnnManagerAdaptor else None
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
