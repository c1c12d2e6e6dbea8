"""Find the QNN runtime libraries and make ExecuTorch's Qualcomm backend usable, with no download.

ExecuTorch's Qualcomm code expects a QAIRT SDK laid out as `$QNN_SDK_ROOT/lib/<host>/libQnnHtp.so` and, when
`QNN_SDK_ROOT` is unset, tries to download one from Qualcomm (which fails without that network). Three sources
are supported instead:

1. a real SDK the user points `QNN_SDK_ROOT` at (validated, never modified);
2. on x86_64 Linux, the libraries shipped by the registry package `onnxruntime-qnn==2.5.0` (QAIRT 2.49.40): a
   small cache folder `<cache>/qnn-sdk/2.5.0/` whose `lib/x86_64-linux-clang` is a symlink to the installed
   package folder becomes `QNN_SDK_ROOT`;
3. on aarch64 Linux (a Snapdragon device), the libraries of the registry package `qnnruntime` (its version's
   first two numbers are the QAIRT major.minor, e.g. 2.48.0.2 -> QAIRT 2.48): `<cache>/qnn-sdk/qnnruntime-<version>/`
   whose `lib/aarch64-oe-linux-gcc11.2` is a symlink to the package's `qnnruntime/.libs` becomes `QNN_SDK_ROOT`,
   and its Hexagon skel folders (`.libs/hexagon-v<arch>/unsigned`) are put first in `ADSP_LIBRARY_PATH`, where
   the DSP looks for `libQnnHtpV<arch>Skel.so`.

`registry_libraries()` decides between 2 and 3 without touching the process. A model's QNN context binaries load
only on the QAIRT major.minor that compiled them or a newer one: `check_runtime_can_load()` says so before loading.

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
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

# aarch64 Linux wheels only; the libraries live in `qnnruntime/.libs`, the DSP skels below it.
QNNRUNTIME_DIST = "qnnruntime"
QNNRUNTIME_PACKAGE = "qnnruntime"
QNNRUNTIME_LIB_SUBDIR = ".libs"

# Host folder names under `$QNN_SDK_ROOT/lib/` (QAIRT's own names; `host_lib_dir_patterns` matches both).
X86_64_HOST_DIR = "x86_64-linux-clang"
AARCH64_HOST_DIR = "aarch64-oe-linux-gcc11.2"

SDK_ROOT_ENV = "QNN_SDK_ROOT"
CACHE_ENV = "OPTIMUM_QNN_CACHE"
# Where FastRPC looks for the DSP-side (skel) libraries; a `;`-separated list.
ADSP_LIBRARY_PATH_ENV = "ADSP_LIBRARY_PATH"
SOURCE_USER_SDK = "QNN_SDK_ROOT"
SOURCE_ORT_QNN = f"{ORT_QNN_DIST}=={REQUIRED_ORT_QNN_VERSION}"

HTP_LIBRARY = "libQnnHtp.so"
SYSTEM_LIBRARY = "libQnnSystem.so"
REQUIRED_LIBRARIES = (HTP_LIBRARY, SYSTEM_LIBRARY)

# QAIRT build ids look like `v2.49.40.260810104044` (major.minor.patch.timestamp).
_BUILD_ID_RE = re.compile(rb"v2\.\d{1,3}\.\d{1,3}\.\d{6,}")
_MAJOR_MINOR_RE = re.compile(r"v?(\d+)\.(\d+)(?:\.|$)")
_SKEL_DIR_RE = re.compile(r"hexagon-v(\d+)")


class QnnSdkError(OptimumQnnError, RuntimeError):
    """The QNN libraries cannot be found or used; the message says what was expected where."""


@dataclass(frozen=True)
class QnnSdk:
    """Where the QNN libraries of this process come from.

    Args:
        root: the folder `QNN_SDK_ROOT` points at.
        lib_dir: the host library folder inside `root` (e.g. `lib/x86_64-linux-clang`).
        source: `"QNN_SDK_ROOT"` for a user SDK, else the registry package, e.g. `"onnxruntime-qnn==2.5.0"` or
            `"qnnruntime==2.48.0.2"`.
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
    registry = SOURCE_ORT_QNN if _registry_package(machine, system) is _ORT_QNN else QNNRUNTIME_DIST
    raise QnnSdkError(
        f"{SDK_ROOT_ENV}={root} does not look like a QAIRT SDK for this {machine} host: expected {expected} "
        f"(found: {found}). Point {SDK_ROOT_ENV} at the SDK's top folder (the one holding lib/ and include/), "
        f"or unset it to use the libraries of {registry}."
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


def qairt_major_minor(build_id: str) -> tuple[int, int]:
    """`v2.49.40.260810104044` (or `2.49.40`) -> (2, 49).

    Raises:
        QnnSdkError: for a string that does not start with a QAIRT version.
    """
    match = _MAJOR_MINOR_RE.match(build_id.strip())
    if match is None:
        raise QnnSdkError(f"{build_id!r} is not a QAIRT build id (expected e.g. v2.49.40.260810104044)")
    return int(match.group(1)), int(match.group(2))


def check_runtime_can_load(artifact_build_id: str, runtime_build_id: str, runtime_source: str | None = None) -> None:
    """Refuse a runtime older than the QAIRT that compiled a model's context binaries.

    A QNN context binary compiled with QAIRT major.minor X loads only on a runtime of QAIRT X or newer (patch
    and build do not matter).

    Args:
        artifact_build_id: the QAIRT build id the model was exported with (`manifest.versions.qairt_build_id`).
        runtime_build_id: the build id of the QNN libraries of this process (`QnnSdk.build_id`).
        runtime_source: where those libraries come from (`QnnSdk.source`), named in the message.

    Raises:
        QnnSdkError: naming both versions and the two fixes (newer runtime libraries, or an older export).
    """
    artifact = qairt_major_minor(artifact_build_id)
    runtime = qairt_major_minor(runtime_build_id)
    if runtime >= artifact:
        return
    needed, have = ".".join(map(str, artifact)), ".".join(map(str, runtime))
    origin = f", from {runtime_source}" if runtime_source else ""
    raise QnnSdkError(
        f"This model was compiled with QAIRT {needed} ({artifact_build_id}) but the QNN runtime here is QAIRT {have} "
        f"({runtime_build_id}{origin}); QNN context binaries load only on the QAIRT version that compiled them or a "
        f"newer one. Fix: use QNN libraries of QAIRT {needed} or newer (pip install '{QNNRUNTIME_DIST}>={needed}' "
        f"on an aarch64 device, or set {SDK_ROOT_ENV} to a QAIRT {needed}+ SDK), or re-export the model with "
        f"QAIRT {have} ({SDK_ROOT_ENV} pointing at that SDK during the export)."
    )


def find_skel_dirs(lib_dir: Path) -> dict[int, Path]:
    """The Hexagon skel folders below a library folder, by HTP arch: `{75: lib_dir/hexagon-v75/unsigned, ...}`.

    Only folders holding `libQnnHtpV<arch>Skel.so` count (qnnruntime's `hexagon-v66` holds a calculator only).
    """
    found = {}
    for folder in lib_dir.glob("hexagon-v*/unsigned"):
        match = _SKEL_DIR_RE.fullmatch(folder.parent.name)
        if match and (folder / f"libQnnHtpV{match.group(1)}Skel.so").is_file():
            found[int(match.group(1))] = folder
    return dict(sorted(found.items()))


def adsp_library_path(current: str | None, skel_dirs: Iterable[Path]) -> str:
    """The `ADSP_LIBRARY_PATH` value with `skel_dirs` first, then the entries of `current` not already listed.

    The skel folders go first so the DSP loads the skel of the same release as the CPU-side `libQnnHtp.so` and
    stub, rather than an older `libQnnHtpV<arch>Skel.so` a vendor folder of `current` may hold; the user's
    other entries are kept, in their order. Entries are separated by `;` (FastRPC's separator).
    """
    entries = [str(d) for d in skel_dirs] + [p for p in (current or "").split(";") if p.strip()]
    return ";".join(dict.fromkeys(entries))


@dataclass(frozen=True)
class RegistryLibraries:
    """The QNN libraries a registry package provides for this host.

    Args:
        dist: the distribution name, e.g. `qnnruntime`.
        version: its installed version, e.g. `2.48.0.2`.
        lib_source: the installed folder holding `libQnnHtp.so` and `libQnnSystem.so`.
        host_dir: the folder name it is exposed as under `<root>/lib/`, e.g. `aarch64-oe-linux-gcc11.2`.
        cache_name: the folder of the cache root under `<cache>/qnn-sdk/`, e.g. `qnnruntime-2.48.0.2`.
        skel_dirs: the Hexagon skel folders by HTP arch (`{68: .../hexagon-v68/unsigned, ...}`); empty on x86,
            whose HTP emulator runs in `libQnnHtp.so`.
    """

    dist: str
    version: str
    lib_source: Path
    host_dir: str
    cache_name: str
    skel_dirs: Mapping[int, Path] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """The `QnnSdk.source` label, e.g. `qnnruntime==2.48.0.2`."""
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class _RegistryPackage:
    dist: str
    package: str  # import name
    lib_subdir: str  # the library folder, relative to the package folder
    host_dir: str


_ORT_QNN = _RegistryPackage(ORT_QNN_DIST, ORT_QNN_PACKAGE, "", X86_64_HOST_DIR)
_QNNRUNTIME = _RegistryPackage(QNNRUNTIME_DIST, QNNRUNTIME_PACKAGE, QNNRUNTIME_LIB_SUBDIR, AARCH64_HOST_DIR)


def _registry_package(machine: str, system: str) -> _RegistryPackage | None:
    if system.lower() != "linux":
        return None
    return {"x86_64": _ORT_QNN, "amd64": _ORT_QNN, "aarch64": _QNNRUNTIME, "arm64": _QNNRUNTIME}.get(machine.lower())


def registry_libraries(
    machine: str,
    system: str,
    find_package: Callable[[str], Path | None] | None = None,
    version_of: Callable[[str], str] | None = None,
) -> RegistryLibraries:
    """Which registry package provides the QNN libraries of a host, checked to hold what executorch loads.

    x86_64 Linux: `onnxruntime-qnn==2.5.0` (its package folder, exposed as `x86_64-linux-clang`, cache folder
    `2.5.0`). aarch64 Linux: `qnnruntime` (its `.libs` folder, exposed as `aarch64-oe-linux-gcc11.2`, cache
    folder `qnnruntime-<version>`, plus its Hexagon skel folders).

    Args:
        machine: `platform.machine()` of the host.
        system: `platform.system()` of the host.
        find_package: import name -> installed package folder or None; defaults to a lookup that imports nothing.
        version_of: distribution name -> installed version; defaults to `importlib.metadata.version`.

    Raises:
        QnnSdkError: saying what to install or set, for a host no registry package covers, a missing package, a
            wrong onnxruntime-qnn version, or an installation lacking the libraries.
    """
    find_package = find_package or _find_package_dir
    version_of = version_of or importlib.metadata.version
    package = _registry_package(machine, system)
    if package is None:
        raise QnnSdkError(
            f"No QNN libraries for this {machine} {system} host: optimum-qnn runs on x86_64 Linux (pip install "
            f"{SOURCE_ORT_QNN}) or aarch64 Linux (pip install {QNNRUNTIME_DIST}), or with {SDK_ROOT_ENV} set to a "
            f"QAIRT SDK for a Linux host."
        )
    folder = find_package(package.package)
    if folder is None:
        if package is _ORT_QNN:
            raise QnnSdkError(
                f"No QNN libraries found: {SDK_ROOT_ENV} is unset and {ORT_QNN_DIST} is not installed. "
                f"Fix: pip install {SOURCE_ORT_QNN}, or set {SDK_ROOT_ENV} to a QAIRT SDK."
            )
        raise QnnSdkError(
            f"No QNN libraries found for this aarch64 Linux host: {SDK_ROOT_ENV} is unset and {QNNRUNTIME_DIST} is "
            f"not installed. Fix: pip install {QNNRUNTIME_DIST}, or set {SDK_ROOT_ENV} to a QAIRT SDK."
        )
    version = version_of(package.dist)
    if package is _ORT_QNN:
        check_onnxruntime_qnn_version(version)
    lib_source = folder / package.lib_subdir if package.lib_subdir else folder
    source = f"{package.dist}=={version}"
    missing = [name for name in REQUIRED_LIBRARIES if not (lib_source / name).is_file()]
    if missing:
        raise QnnSdkError(
            f"{source} lacks {', '.join(str(lib_source / name) for name in missing)}: reinstall with "
            f"pip install --force-reinstall {source}, or set {SDK_ROOT_ENV} to a QAIRT SDK."
        )
    skel_dirs: dict[int, Path] = {}
    if package is _QNNRUNTIME:
        skel_dirs = find_skel_dirs(lib_source)
        if not skel_dirs:
            raise QnnSdkError(
                f"{source} lacks the Hexagon skel libraries ({lib_source}/hexagon-v<arch>/unsigned/"
                f"libQnnHtpV<arch>Skel.so) the DSP loads: reinstall with pip install --force-reinstall {source}, "
                f"or set {SDK_ROOT_ENV} to a QAIRT SDK."
            )
    return RegistryLibraries(
        dist=package.dist,
        version=version,
        lib_source=lib_source,
        host_dir=package.host_dir,
        cache_name=version if package is _ORT_QNN else f"{package.dist}-{version}",
        skel_dirs=skel_dirs,
    )


# ---------------------------------------------------------------------------------------------------------------
# Process set-up
# ---------------------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_sdk: QnnSdk | None = None


def ensure_qnn_sdk() -> QnnSdk:
    """Make ExecuTorch's Qualcomm backend usable in this process and say where its libraries come from.

    Call it before anything lowers to or runs on QNN (executorch reads `QNN_SDK_ROOT` when a backend starts and
    downloads an SDK when it is unset). Idempotent and thread-safe: later calls return the cached result.

    Effects on the process: sets `QNN_SDK_ROOT` (registry libraries only), puts qnnruntime's Hexagon skel
    folders first in `ADSP_LIBRARY_PATH` (aarch64), appends the library folder to `LD_LIBRARY_PATH` (seen by
    child processes, not by this one's loader), imports torch, then loads `libQnnHtp.so` and `libQnnSystem.so`
    globally so executorch's `dlopen("libQnnHtp.so")` finds them by name.

    Returns:
        The `QnnSdk` in use.

    Raises:
        QnnSdkError: a `QNN_SDK_ROOT` with the wrong layout, no registry package for this host (onnxruntime-qnn
            on x86_64, qnnruntime on aarch64), the wrong onnxruntime-qnn, or a library that fails to load.
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
    user_root = os.environ.get(SDK_ROOT_ENV)
    registry: RegistryLibraries | None = None
    if user_root:
        root = Path(user_root).expanduser().absolute()
        lib_dir = find_host_lib_dir(root, machine, system)
        # A QNN_SDK_ROOT inherited from a parent process that set it up from a registry package is still the
        # registry libraries: label (and check) them as such.
        if _is_registry_lib_dir(lib_dir, machine, system):
            registry = registry_libraries(machine, system)
            source = registry.source
        else:
            source = SOURCE_USER_SDK
    else:
        registry = registry_libraries(machine, system)
        root = _link_cache_root(registry.lib_source, registry.cache_name, registry.host_dir)
        lib_dir = root / "lib" / registry.host_dir
        source = registry.source
        os.environ[SDK_ROOT_ENV] = str(root)

    if registry is not None and registry.skel_dirs:
        os.environ[ADSP_LIBRARY_PATH_ENV] = adsp_library_path(
            os.environ.get(ADSP_LIBRARY_PATH_ENV), (d.resolve() for d in registry.skel_dirs.values())
        )
    _append_ld_library_path(lib_dir)
    _load_globally(lib_dir)
    htp_library = lib_dir / HTP_LIBRARY
    return QnnSdk(root=root, lib_dir=lib_dir, source=source, build_id=read_build_id(htp_library), htp_library=htp_library)


def _is_registry_lib_dir(lib_dir: Path, machine: str, system: str) -> bool:
    """Whether `lib_dir` is (a link to) the library folder of this host's installed registry package."""
    package = _registry_package(machine, system)
    folder = _find_package_dir(package.package) if package else None
    if folder is None:
        return False
    lib_source = folder / package.lib_subdir if package.lib_subdir else folder
    return lib_source.exists() and lib_dir.resolve() == lib_source.resolve()


def _find_package_dir(package: str) -> Path | None:
    """The installed folder of a package, found without importing it (onnxruntime_qnn's `__init__` loads
    onnxruntime, qnnruntime's its extension)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _find_ort_qnn_dir() -> Path | None:
    """The installed `onnxruntime_qnn/` folder."""
    return _find_package_dir(ORT_QNN_PACKAGE)


def _cache_home() -> Path:
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "optimum-qnn"


def _link_cache_root(lib_source: Path, name: str, host_dir: str = X86_64_HOST_DIR) -> Path:
    """`<cache>/qnn-sdk/<name>/` with `lib/<host_dir>` -> `lib_source`; returns the root.

    The link is created under a unique temporary name and renamed over the final one, so concurrent processes
    (pytest-xdist, two exports) never see a missing or half-made link. An existing link to another folder (an
    older venv) is replaced the same way.
    """
    root = _cache_home() / "qnn-sdk" / name
    link = root / "lib" / host_dir
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
