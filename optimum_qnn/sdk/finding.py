"""Where the QNN libraries of a host are: a QAIRT SDK the user points at, or the registry package.

Pure functions of paths and host names: nothing here loads a library or changes the process (`loading.py` does).

The registry package is `onnxruntime-qnn==2.5.0` on every host it publishes a wheel for, all carrying the QAIRT
2.49.40 libraries that the export compiles with (file lists read from the registry's wheels):

| host | wheel | HTP / System library | Hexagon skels |
|---|---|---|---|
| x86_64 Linux | manylinux x86_64 | `libQnnHtp.so` (holds the HTP emulator), `libQnnSystem.so` | none |
| aarch64 Linux | `manylinux_2_34_aarch64` | `libQnnHtp.so`, `libQnnSystem.so` | `libQnnHtpV{68,69,73,75,79,81}Skel.so`, flat |
| Windows on Snapdragon | `win_arm64` | `QnnHtp.dll`, `QnnSystem.dll` | `libQnnHtpV{68,73,81}Skel.so` + `libqnnhtpv{73,81}.cat` |

On Linux the DSP loads its skel through FastRPC, which searches `ADSP_LIBRARY_PATH`; the package folder goes
first there. On Windows the skel is found beside the HTP library and its signed catalog (`libqnnhtpv<arch>.cat`)
must sit in the same folder (Qualcomm's "Windows HTP Library Loading" notes): nothing is set, the layout is checked.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from optimum_qnn.errors import OptimumQnnError

ORT_QNN_DIST = "onnxruntime-qnn"
ORT_QNN_PACKAGE = "onnxruntime_qnn"
# Exact pin: 2.3.0, 2.4.0, 2.6.0 and 2.7.0 ship QNN libraries whose device-config struct layout differs from
# the one executorch 1.5.1 was built against; device creation fails with the error quoted below.
REQUIRED_ORT_QNN_VERSION = "2.5.0"
# The QAIRT release inside each accepted onnxruntime-qnn (read from its libQnnHtp build id).
ORT_QNN_QAIRT = {"2.5.0": "2.49.40"}
_ORT_QNN_MISMATCH_ERROR = "unknown custom config socModel 0"

SDK_ROOT_ENV = "QNN_SDK_ROOT"
SOURCE_USER_SDK = "QNN_SDK_ROOT"
SOURCE_ORT_QNN = f"{ORT_QNN_DIST}=={REQUIRED_ORT_QNN_VERSION}"

# Host folder names under `$QNN_SDK_ROOT/lib/` (QAIRT's own names).
X86_64_HOST_DIR = "x86_64-linux-clang"
AARCH64_HOST_DIR = "aarch64-oe-linux-gcc11.2"
WINDOWS_ARM64_HOST_DIR = "aarch64-windows-msvc"

HTP_LIBRARY = "libQnnHtp.so"
SYSTEM_LIBRARY = "libQnnSystem.so"
REQUIRED_LIBRARIES = (HTP_LIBRARY, SYSTEM_LIBRARY)
WINDOWS_LIBRARIES = ("QnnHtp.dll", "QnnSystem.dll")

_SKEL_RE = re.compile(r"libQnnHtpV(\d+)Skel\.so")
_SKEL_DIR_RE = re.compile(r"hexagon-v(\d+)")


class QnnSdkError(OptimumQnnError, RuntimeError):
    """The QNN libraries cannot be found or used; the message says what was expected where."""


@dataclass(frozen=True)
class Host:
    """What one kind of host needs: its SDK folder names, its library file names, how its DSP finds skels.

    Args:
        name: e.g. `aarch64 Linux`, used in messages.
        lib_patterns: glob patterns under `$QNN_SDK_ROOT/lib/`, in order of preference.
        host_dir: the folder name a registry package is exposed as under `<cache root>/lib/`.
        libraries: (HTP backend, System library) file names.
        skels: where the DSP looks for skels: `"none"` (the x86 emulator runs in the HTP library),
            `"adsp_library_path"` (Linux FastRPC) or `"beside_library"` (Windows).
    """

    name: str
    lib_patterns: tuple[str, ...]
    host_dir: str
    libraries: tuple[str, str] = REQUIRED_LIBRARIES
    skels: str = "none"

    @property
    def htp_library(self) -> str:
        return self.libraries[0]

    @property
    def system_library(self) -> str:
        return self.libraries[1]


X86_64_LINUX = Host("x86_64 Linux", ("x86_64-linux-clang",), X86_64_HOST_DIR)
AARCH64_LINUX = Host("aarch64 Linux", ("aarch64-oe-linux-gcc*",), AARCH64_HOST_DIR, skels="adsp_library_path")
WINDOWS_ARM64 = Host(
    "Windows on Snapdragon (ARM64)", ("aarch64-windows-msvc", "arm64x-windows-msvc"), WINDOWS_ARM64_HOST_DIR,
    libraries=WINDOWS_LIBRARIES, skels="beside_library",
)
_SUPPORTED = "x86_64 Linux, aarch64 Linux, Windows on Snapdragon (ARM64)"


def host_for(machine: str, system: str) -> Host:
    """The `Host` of a `platform.machine()` / `platform.system()` pair.

    Raises:
        QnnSdkError: for a host QAIRT publishes no libraries for, naming the supported ones.
    """
    machine, system_l = machine.lower(), system.lower()
    if system_l == "linux" and machine in ("x86_64", "amd64"):
        return X86_64_LINUX
    if system_l == "linux" and machine in ("aarch64", "arm64"):
        return AARCH64_LINUX
    if system_l == "windows" and machine in ("arm64", "aarch64"):
        return WINDOWS_ARM64
    raise QnnSdkError(f"No QNN host libraries for this {machine} {system} host; supported hosts: {_SUPPORTED}")


def host_lib_dir_patterns(machine: str, system: str = "Linux") -> tuple[str, ...]:
    """Glob patterns, relative to `$QNN_SDK_ROOT/lib`, of the library folder for a host.

    Returns:
        Patterns in order of preference, e.g. `("x86_64-linux-clang",)` or `("aarch64-oe-linux-gcc*",)`
        (QAIRT names its aarch64 Linux folders after the toolchain: `aarch64-oe-linux-gcc11.2`, `...gcc9.3`).

    Raises:
        QnnSdkError: for a host QAIRT publishes no libraries for.
    """
    return host_for(machine, system).lib_patterns


def _toolchain_version(folder: Path) -> tuple[int, ...]:
    """`aarch64-oe-linux-gcc11.2` -> (11, 2), so the newest toolchain sorts first when reversed."""
    if "gcc" not in folder.name:
        return ()
    return tuple(int(n) for n in re.findall(r"\d+", folder.name.rsplit("gcc", 1)[-1]))


def find_host_lib_dir(root: Path, machine: str, system: str) -> Path:
    """The host library folder of an SDK at `root`, checked to hold the HTP and System libraries.

    Raises:
        QnnSdkError: naming the folder and the files that were expected there.
    """
    host = host_for(machine, system)
    expected = " or ".join(f"{root}/lib/{p}/{{{','.join(host.libraries)}}}" for p in host.lib_patterns)
    if not root.is_dir():
        raise QnnSdkError(f"{SDK_ROOT_ENV}={root} is not a folder; expected a QAIRT SDK holding {expected}")
    candidates: list[Path] = []
    for pattern in host.lib_patterns:  # patterns in order of preference, the newest toolchain first within one
        found = sorted((d for d in (root / "lib").glob(pattern) if d.is_dir()), key=_toolchain_version, reverse=True)
        candidates += found
    for lib_dir in candidates:
        if all((lib_dir / name).is_file() for name in host.libraries):
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


def find_skel_dirs(folder: Path) -> dict[int, Path]:
    """The folders holding a Hexagon skel, by HTP arch: `{75: folder, ...}`.

    Both layouts count: skels flat in `folder` (onnxruntime-qnn's wheels) and QAIRT's
    `folder/hexagon-v<arch>/unsigned/libQnnHtpV<arch>Skel.so` (pass the SDK's `lib/`).
    """
    found: dict[int, Path] = {}
    for skel in folder.glob("libQnnHtpV*Skel.so"):
        match = _SKEL_RE.fullmatch(skel.name)
        if match:
            found[int(match.group(1))] = folder
    for sub in folder.glob("hexagon-v*/unsigned"):
        match = _SKEL_DIR_RE.fullmatch(sub.parent.name)
        if match and (sub / f"libQnnHtpV{match.group(1)}Skel.so").is_file():
            found.setdefault(int(match.group(1)), sub)
    return dict(sorted(found.items()))


def unsigned_windows_skels(skel_dirs: Mapping[int, Path]) -> list[int]:
    """The HTP archs whose skel lacks its catalog `libqnnhtpv<arch>.cat` beside it.

    Windows verifies a skel's signature through that catalog before the NPU runs it (Snapdragon X and later);
    onnxruntime-qnn 2.5.0's win_arm64 wheel ships catalogs for v73 and v81, not for v68.
    """
    return [arch for arch, folder in skel_dirs.items() if not (folder / f"libqnnhtpv{arch}.cat").is_file()]


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
    """The QNN libraries the registry package provides for this host.

    Args:
        dist: the distribution name, `onnxruntime-qnn`.
        version: its installed version, `2.5.0`.
        lib_source: the installed folder holding the HTP and System libraries.
        host: the kind of host (folder names, library names, how skels are found).
        cache_name: the folder of the cache root under `<cache>/qnn-sdk/`: the version and a key of the package
            folder, e.g. `2.5.0-3f2a9c1e`, so each environment of a user keeps a root of its own.
        skel_dirs: the Hexagon skel folders by HTP arch; empty on x86, whose HTP emulator runs in `libQnnHtp.so`.
    """

    dist: str
    version: str
    lib_source: Path
    host: Host
    cache_name: str
    skel_dirs: Mapping[int, Path] = field(default_factory=dict)

    @property
    def host_dir(self) -> str:
        """The folder name it is exposed as under `<root>/lib/`, e.g. `aarch64-oe-linux-gcc11.2`."""
        return self.host.host_dir

    @property
    def source(self) -> str:
        """The `QnnSdk.source` label, e.g. `onnxruntime-qnn==2.5.0`."""
        return f"{self.dist}=={self.version}"


def registry_libraries(
    machine: str,
    system: str,
    find_package: Callable[[str], Path | None] | None = None,
    version_of: Callable[[str], str] | None = None,
) -> RegistryLibraries:
    """The registry package's QNN libraries for a host, checked to hold what ExecuTorch and the DSP load.

    Args:
        machine: `platform.machine()` of the host.
        system: `platform.system()` of the host.
        find_package: import name -> installed package folder or None; defaults to a lookup that imports nothing.
        version_of: distribution name -> installed version; defaults to `importlib.metadata.version`.

    Raises:
        QnnSdkError: saying what to install or set, for a host no wheel covers, a missing package, a wrong
            onnxruntime-qnn version, or an installation lacking the libraries or (on a Snapdragon host) the skels.
    """
    find_package = find_package or find_package_dir
    version_of = version_of or importlib.metadata.version
    host = host_for(machine, system)
    folder = find_package(ORT_QNN_PACKAGE)
    if folder is None:
        raise QnnSdkError(
            f"No QNN libraries found for this {host.name} host: {SDK_ROOT_ENV} is unset and {ORT_QNN_DIST} is not "
            f"installed. Fix: pip install {SOURCE_ORT_QNN}, or set {SDK_ROOT_ENV} to a QAIRT SDK."
        )
    version = version_of(ORT_QNN_DIST)
    check_onnxruntime_qnn_version(version)
    source = f"{ORT_QNN_DIST}=={version}"
    reinstall = f"reinstall with pip install --force-reinstall {source}, or set {SDK_ROOT_ENV} to a QAIRT SDK."
    missing = [name for name in host.libraries if not (folder / name).is_file()]
    if missing:
        raise QnnSdkError(f"{source} lacks {', '.join(str(folder / name) for name in missing)}: {reinstall}")
    skel_dirs: dict[int, Path] = {}
    if host.skels != "none":
        skel_dirs = find_skel_dirs(folder)
        if not skel_dirs:
            raise QnnSdkError(
                f"{source} lacks the Hexagon skel libraries ({folder}/libQnnHtpV<arch>Skel.so) the NPU loads: "
                f"{reinstall}"
            )
    return RegistryLibraries(
        dist=ORT_QNN_DIST, version=version, lib_source=folder, host=host, cache_name=cache_name(version, folder),
        skel_dirs=skel_dirs,
    )


def cache_name(version: str, package_dir: Path) -> str:
    """`<version>-<8 hex digits of the resolved package folder>`: one cache root per environment, never shared."""
    key = hashlib.sha256(str(package_dir.resolve()).encode()).hexdigest()[:8]
    return f"{version}-{key}"


def find_package_dir(package: str) -> Path | None:
    """The installed folder of a package, found without importing it (onnxruntime_qnn's `__init__` loads
    onnxruntime)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))
