"""optimum_qnn.sdk and the doctor command: finding, validating and loading the QNN libraries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from optimum_qnn.config import Soc
from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.sdk.finding import cache_name
from optimum_qnn.sdk import (
    QnnSdkError,
    adsp_library_path,
    check_onnxruntime_qnn_version,
    check_runtime_can_load,
    find_host_lib_dir,
    find_skel_dirs,
    host_lib_dir_patterns,
    parse_build_id,
    qairt_major_minor,
    registry_libraries,
    supported_socs,
    unsigned_windows_skels,
)

BUILD_ID_PREFIX = "v2.49.40"

# Prints what ensure_qnn_sdk() found, as JSON, in a child process.
_PRINT_SDK = (
    "import json, os\n"
    "from optimum_qnn.sdk import ensure_qnn_sdk\n"
    "sdk = ensure_qnn_sdk()\n"
    "print(json.dumps({'root': str(sdk.root), 'lib_dir': str(sdk.lib_dir), 'source': sdk.source,\n"
    "                  'build_id': sdk.build_id, 'env_root': os.environ['QNN_SDK_ROOT']}))\n"
)


def _make_libs(folder: Path, names=("libQnnHtp.so", "libQnnSystem.so")) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_bytes(b"\x7fELF")
    return folder


# The file lists of the registry's onnxruntime-qnn 2.5.0 wheels for Snapdragon hosts (names only, read with
# `unzip -l`; the libraries themselves are never in the repo).
WHEELS = Path(__file__).parent / "data" / "wheels"
AARCH64_WHEEL = "onnxruntime_qnn-2.5.0-manylinux_2_34_aarch64.txt"
WIN_ARM64_WHEEL = "onnxruntime_qnn-2.5.0-win_arm64.txt"


def _wheel_files(listing: str) -> list[str]:
    lines = (WHEELS / listing).read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def _install_wheel(site: Path, listing: str, without: tuple[str, ...] = ()) -> Path:
    """`site/onnxruntime_qnn/` laid out like the installed wheel (empty files), minus the names in `without`."""
    for relative in _wheel_files(listing):
        if relative.startswith("onnxruntime_qnn/") and relative.split("/", 1)[1] not in without:
            (site / relative).parent.mkdir(parents=True, exist_ok=True)
            (site / relative).write_bytes(b"")
    return site / "onnxruntime_qnn"


def _installed(packages: dict[str, Path], versions: dict[str, str]):
    """`find_package` and `version_of` stand-ins for `registry_libraries`: only these packages are installed."""
    return packages.get, versions.__getitem__


# --- pure functions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "system", "expected"),
    [
        ("x86_64", "Linux", ("x86_64-linux-clang",)),
        ("AMD64", "Linux", ("x86_64-linux-clang",)),
        ("aarch64", "Linux", ("aarch64-oe-linux-gcc*",)),
        ("ARM64", "Windows", ("aarch64-windows-msvc", "arm64x-windows-msvc")),
    ],
)
def test_host_lib_dir_patterns(machine, system, expected):
    assert host_lib_dir_patterns(machine, system) == expected


@pytest.mark.parametrize(
    ("machine", "system"), [("riscv64", "Linux"), ("x86_64", "Darwin"), ("arm64", "Darwin"), ("AMD64", "Windows")]
)
def test_hosts_without_qnn_libraries_are_refused(machine, system):
    with pytest.raises(QnnSdkError) as info:
        host_lib_dir_patterns(machine, system)
    assert str(info.value) == (
        f"No QNN host libraries for this {machine.lower()} {system} host; supported hosts: x86_64 Linux, "
        "aarch64 Linux, Windows on Snapdragon (ARM64)"
    )


def test_aarch64_host_picks_newest_toolchain_folder(tmp_path):
    _make_libs(tmp_path / "lib" / "aarch64-oe-linux-gcc9.3")
    newest = _make_libs(tmp_path / "lib" / "aarch64-oe-linux-gcc11.2")
    _make_libs(tmp_path / "lib" / "x86_64-linux-clang")
    assert find_host_lib_dir(tmp_path, machine="aarch64", system="Linux") == newest
    assert find_host_lib_dir(tmp_path, machine="x86_64", system="Linux") == tmp_path / "lib" / "x86_64-linux-clang"


def test_windows_sdk_folder(tmp_path):
    lib_dir = _make_libs(tmp_path / "lib" / "aarch64-windows-msvc", names=("QnnHtp.dll", "QnnSystem.dll"))
    assert find_host_lib_dir(tmp_path, machine="ARM64", system="Windows") == lib_dir
    _make_libs(tmp_path / "other" / "lib" / "aarch64-windows-msvc")  # Linux names: not a Windows SDK
    with pytest.raises(QnnSdkError, match=r"aarch64-windows-msvc/\{QnnHtp.dll,QnnSystem.dll\}"):
        find_host_lib_dir(tmp_path / "other", machine="ARM64", system="Windows")


def test_aarch64_sdk_refused_on_x86_host(tmp_path):
    _make_libs(tmp_path / "lib" / "aarch64-oe-linux-gcc11.2")
    with pytest.raises(QnnSdkError) as info:
        find_host_lib_dir(tmp_path, machine="x86_64", system="Linux")
    assert f"expected {tmp_path}/lib/x86_64-linux-clang/{{libQnnHtp.so,libQnnSystem.so}}" in str(info.value)


def test_incomplete_sdk_names_the_missing_layout(tmp_path):
    _make_libs(tmp_path / "lib" / "x86_64-linux-clang", names=("libQnnHtp.so",))
    with pytest.raises(QnnSdkError, match="libQnnSystem.so") as info:
        find_host_lib_dir(tmp_path, machine="x86_64", system="Linux")
    assert "found: " + str(tmp_path / "lib" / "x86_64-linux-clang") in str(info.value)


def test_sdk_root_that_is_not_a_folder(tmp_path):
    with pytest.raises(QnnSdkError, match="is not a folder"):
        find_host_lib_dir(tmp_path / "nope", machine="x86_64", system="Linux")


def test_wrong_onnxruntime_qnn_version_message():
    check_onnxruntime_qnn_version("2.5.0")  # the pinned one passes
    with pytest.raises(QnnSdkError) as info:
        check_onnxruntime_qnn_version("2.7.0")
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, OptimumQnnError)
    assert str(info.value) == (
        "onnxruntime-qnn==2.5.0 is required; found 2.7.0, whose QNN libraries executorch 1.5.1 cannot configure "
        "(fails with 'unknown custom config socModel 0'). Fix: pip install onnxruntime-qnn==2.5.0"
    )


@pytest.mark.parametrize("machine", ["aarch64", "arm64"])
def test_aarch64_linux_uses_the_onnxruntime_qnn_aarch64_wheel(tmp_path, machine):
    package = _install_wheel(tmp_path / "site", AARCH64_WHEEL)
    find, version_of = _installed({"onnxruntime_qnn": package}, {"onnxruntime-qnn": "2.5.0"})
    libs = registry_libraries(machine, "Linux", find_package=find, version_of=version_of)
    assert libs.source == "onnxruntime-qnn==2.5.0"
    assert libs.lib_source == package
    assert libs.host_dir == "aarch64-oe-linux-gcc11.2" and libs.cache_name == cache_name("2.5.0", package)
    # The wheel puts every skel flat beside libQnnHtp.so: that one folder serves each HTP arch.
    assert dict(libs.skel_dirs) == {arch: package for arch in (68, 69, 73, 75, 79, 81)}
    # The exposed host folder is one find_host_lib_dir looks for on aarch64 (an inherited QNN_SDK_ROOT).
    (tmp_path / "probe" / "lib" / libs.host_dir).mkdir(parents=True)
    globbed = [d.name for p in host_lib_dir_patterns(machine, "Linux") for d in (tmp_path / "probe" / "lib").glob(p)]
    assert globbed == [libs.host_dir]


def test_windows_on_snapdragon_uses_the_onnxruntime_qnn_win_arm64_wheel(tmp_path):
    package = _install_wheel(tmp_path / "site", WIN_ARM64_WHEEL)
    find, version_of = _installed({"onnxruntime_qnn": package}, {"onnxruntime-qnn": "2.5.0"})
    libs = registry_libraries("ARM64", "Windows", find_package=find, version_of=version_of)
    assert libs.source == "onnxruntime-qnn==2.5.0" and libs.lib_source == package
    assert (libs.host.htp_library, libs.host.system_library) == ("QnnHtp.dll", "QnnSystem.dll")
    assert libs.host.skels == "beside_library"  # Windows finds the skels beside QnnHtp.dll: nothing to set
    assert dict(libs.skel_dirs) == {68: package, 73: package, 81: package}
    # The catalogs Windows verifies a skel's signature with: the wheel has them for v73 and v81 only.
    assert unsigned_windows_skels(libs.skel_dirs) == [68]


def test_x86_64_linux_resolves_to_onnxruntime_qnn(tmp_path):
    ort = _make_libs(tmp_path / "site" / "onnxruntime_qnn")
    find, version_of = _installed({"onnxruntime_qnn": ort}, {"onnxruntime-qnn": "2.5.0"})
    libs = registry_libraries("x86_64", "Linux", find_package=find, version_of=version_of)
    assert (libs.dist, libs.version, libs.source) == ("onnxruntime-qnn", "2.5.0", "onnxruntime-qnn==2.5.0")
    assert libs.lib_source == ort
    assert libs.host_dir == "x86_64-linux-clang"
    # One root per package folder: the version and a key of the folder's resolved path.
    assert libs.cache_name == cache_name("2.5.0", ort) and libs.cache_name.startswith("2.5.0-")
    assert cache_name("2.5.0", tmp_path / "other") != libs.cache_name
    assert dict(libs.skel_dirs) == {}


@pytest.mark.parametrize(
    ("machine", "system", "host"),
    [("x86_64", "Linux", "x86_64 Linux"), ("aarch64", "Linux", "aarch64 Linux"),
     ("ARM64", "Windows", "Windows on Snapdragon (ARM64)")],
)
def test_no_onnxruntime_qnn_says_what_to_do(machine, system, host):
    find, version_of = _installed({}, {})
    with pytest.raises(QnnSdkError) as info:
        registry_libraries(machine, system, find_package=find, version_of=version_of)
    assert str(info.value) == (
        f"No QNN libraries found for this {host} host: QNN_SDK_ROOT is unset and onnxruntime-qnn is not installed. "
        "Fix: pip install onnxruntime-qnn==2.5.0, or set QNN_SDK_ROOT to a QAIRT SDK."
    )


@pytest.mark.parametrize(("machine", "system"), [("aarch64", "Linux"), ("ARM64", "Windows")])
def test_other_onnxruntime_qnn_versions_are_refused_on_arm_hosts(tmp_path, machine, system):
    listing = AARCH64_WHEEL if system == "Linux" else WIN_ARM64_WHEEL
    find, version_of = _installed({"onnxruntime_qnn": _install_wheel(tmp_path, listing)}, {"onnxruntime-qnn": "2.7.0"})
    with pytest.raises(QnnSdkError, match="onnxruntime-qnn==2.5.0 is required; found 2.7.0"):
        registry_libraries(machine, system, find_package=find, version_of=version_of)


@pytest.mark.parametrize(
    ("machine", "system", "listing", "missing"),
    [
        ("aarch64", "Linux", AARCH64_WHEEL, "libQnnHtp.so"),
        ("aarch64", "Linux", AARCH64_WHEEL, "libQnnSystem.so"),
        ("ARM64", "Windows", WIN_ARM64_WHEEL, "QnnHtp.dll"),
    ],
)
def test_wheel_missing_a_library(tmp_path, machine, system, listing, missing):
    package = _install_wheel(tmp_path, listing, without=(missing,))
    find, version_of = _installed({"onnxruntime_qnn": package}, {"onnxruntime-qnn": "2.5.0"})
    with pytest.raises(QnnSdkError) as info:
        registry_libraries(machine, system, find_package=find, version_of=version_of)
    assert str(info.value) == (
        f"onnxruntime-qnn==2.5.0 lacks {package / missing}: reinstall with "
        "pip install --force-reinstall onnxruntime-qnn==2.5.0, or set QNN_SDK_ROOT to a QAIRT SDK."
    )


def test_aarch64_wheel_without_htp_skels(tmp_path):
    skels = tuple(f"libQnnHtpV{arch}Skel.so" for arch in (68, 69, 73, 75, 79, 81))
    package = _install_wheel(tmp_path, AARCH64_WHEEL, without=skels)
    find, version_of = _installed({"onnxruntime_qnn": package}, {"onnxruntime-qnn": "2.5.0"})
    with pytest.raises(QnnSdkError, match=r"onnxruntime-qnn==2\.5\.0 lacks the Hexagon skel libraries") as info:
        registry_libraries("aarch64", "Linux", find_package=find, version_of=version_of)
    assert "pip install --force-reinstall onnxruntime-qnn==2.5.0" in str(info.value)


def test_skels_of_a_qairt_sdk_layout(tmp_path):
    for arch in (73, 75):
        _make_libs(tmp_path / "lib" / f"hexagon-v{arch}" / "unsigned", names=(f"libQnnHtpV{arch}Skel.so",))
    _make_libs(tmp_path / "lib" / "hexagon-v66" / "unsigned", names=("libCalculator_skel.so",))  # no HTP skel
    assert find_skel_dirs(tmp_path / "lib") == {
        73: tmp_path / "lib" / "hexagon-v73" / "unsigned", 75: tmp_path / "lib" / "hexagon-v75" / "unsigned"
    }


def test_adsp_library_path_puts_the_skel_folders_first():
    skels = [Path("/opt/qairt/lib/hexagon-v73/unsigned"), Path("/opt/qairt/lib/hexagon-v75/unsigned")]
    ours = "/opt/qairt/lib/hexagon-v73/unsigned;/opt/qairt/lib/hexagon-v75/unsigned"
    assert adsp_library_path(None, skels) == ours
    assert adsp_library_path("", skels) == ours
    # The user's entries follow, in their order, without empties or repeats (a second set-up adds nothing).
    mixed = adsp_library_path("/vendor/dsp/cdsp;;/usr/lib/rfsa/adsp;", skels)
    assert mixed == f"{ours};/vendor/dsp/cdsp;/usr/lib/rfsa/adsp"
    again = adsp_library_path(f"{ours};/vendor/dsp/cdsp", skels)
    assert again == f"{ours};/vendor/dsp/cdsp" and adsp_library_path(again, skels) == again
    assert adsp_library_path("/dsp;/opt/qairt/lib/hexagon-v75/unsigned", skels) == f"{ours};/dsp"


def test_qairt_major_minor():
    assert qairt_major_minor("v2.49.40.260810104044") == (2, 49)
    assert qairt_major_minor("2.48.0") == (2, 48)
    assert qairt_major_minor("v3.0") == (3, 0)
    for bad in ("", "qnn-2.49", "v2", "2.49x"):
        with pytest.raises(QnnSdkError, match="is not a QAIRT build id"):
            qairt_major_minor(bad)


def test_newer_artifact_refused_by_older_runtime():
    with pytest.raises(QnnSdkError) as info:
        check_runtime_can_load("v2.49.40.260810104044", "v2.48.0.250915123456", runtime_source="QNN_SDK_ROOT")
    assert isinstance(info.value, OptimumQnnError)
    assert str(info.value) == (
        "This model was compiled with QAIRT 2.49 (v2.49.40.260810104044) but the QNN runtime here is QAIRT 2.48 "
        "(v2.48.0.250915123456, from QNN_SDK_ROOT); QNN context binaries load only on the QAIRT version "
        "that compiled them or a newer one. Fix: pip install onnxruntime-qnn==2.5.0 (QAIRT 2.49.40; wheels for "
        "x86_64 Linux, aarch64 Linux and Windows on Snapdragon), or set QNN_SDK_ROOT to a QAIRT 2.49+ SDK; or "
        "re-export the model with QAIRT 2.48 (QNN_SDK_ROOT pointing at that SDK during the export)."
    )
    # The package named is the one whose registry wheels' layouts the tests above use.
    for listing in (AARCH64_WHEEL, WIN_ARM64_WHEEL):
        assert listing.startswith("onnxruntime_qnn-2.5.0-")
    with pytest.raises(QnnSdkError, match=r"compiled with QAIRT 2\.10 .* QNN runtime here is QAIRT 2\.9 \(v2\.9\.1\)"):
        check_runtime_can_load("v2.10.0", "v2.9.1")  # compared as numbers, not strings


def test_artifact_newer_than_any_registry_package():
    with pytest.raises(QnnSdkError) as info:
        check_runtime_can_load("v2.51.0.261001000000", "v2.49.40.260810104044", runtime_source="onnxruntime-qnn==2.5.0")
    assert "Fix: set QNN_SDK_ROOT to a QAIRT 2.51+ SDK (no registry package carries it: onnxruntime-qnn==2.5.0 has " \
        "QAIRT 2.49.40); or re-export the model with QAIRT 2.49" in str(info.value)


@pytest.mark.parametrize(
    ("artifact", "runtime"),
    [
        ("v2.49.40.260810104044", "v2.49.40.260810104044"),  # the same build
        ("v2.49.40.260810104044", "v2.49.0.250101000000"),  # an older patch of the same major.minor
        ("v2.48.0.250915123456", "v2.49.40.260810104044"),  # a newer minor
        ("v2.9.0.250101000000", "v2.10.0.250101000000"),
        ("v2.49.40.260810104044", "v3.0.0.270101000000"),  # a newer major
    ],
)
def test_same_or_newer_runtime_loads(artifact, runtime):
    check_runtime_can_load(artifact, runtime)


def test_parse_build_id():
    assert parse_build_id(b"\0junk v2.49.40.260810104044\0v2.50.1.999999") == "v2.49.40.260810104044"
    assert parse_build_id(b"v2.49 and 2.49.40.260810104044 without the v") is None


def test_supported_socs_match_executorch_chipsets():
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset, _soc_info_table

    socs = supported_socs()
    assert set(socs) == set(Soc)
    for soc in socs:
        assert int(_soc_info_table[QcomChipset[soc.name]].htp_info.htp_arch) == soc.htp_arch


# --- this process -----------------------------------------------------------------------------------------------


def test_registry_libraries_set_up(qnn_sdk):
    from optimum_qnn.sdk.loading import _find_ort_qnn_dir, ensure_qnn_sdk

    assert ensure_qnn_sdk() is qnn_sdk  # cached
    assert qnn_sdk.build_id.startswith(BUILD_ID_PREFIX)
    assert qnn_sdk.qairt_version == "2.49.40"
    # The API's answer and the bytes agree.
    assert parse_build_id(qnn_sdk.htp_library.read_bytes()) == qnn_sdk.build_id
    if qnn_sdk.source == "onnxruntime-qnn==2.5.0":
        assert qnn_sdk.lib_dir.resolve() == _find_ort_qnn_dir().resolve()
    assert os.environ["QNN_SDK_ROOT"] == str(qnn_sdk.root)
    assert str(qnn_sdk.lib_dir) in os.environ["LD_LIBRARY_PATH"].split(os.pathsep)


def test_cache_link_for_the_aarch64_host_folder(tmp_path, monkeypatch):
    from optimum_qnn.sdk.loading import _link_cache_root

    monkeypatch.setenv("OPTIMUM_QNN_CACHE", str(tmp_path / "cache"))
    package = _install_wheel(tmp_path / "site", AARCH64_WHEEL)
    find, version_of = _installed({"onnxruntime_qnn": package}, {"onnxruntime-qnn": "2.5.0"})
    libs = registry_libraries("aarch64", "Linux", find_package=find, version_of=version_of)
    root = _link_cache_root(libs.lib_source, libs.cache_name, libs.host_dir)
    link = root / "lib" / "aarch64-oe-linux-gcc11.2"
    assert root == tmp_path / "cache" / "qnn-sdk" / cache_name("2.5.0", package)
    assert link.is_symlink() and link.resolve() == package
    assert _link_cache_root(libs.lib_source, libs.cache_name, libs.host_dir) == root  # idempotent
    assert [p.name for p in link.parent.iterdir()] == ["aarch64-oe-linux-gcc11.2"]
    # The root is a valid QAIRT layout for an aarch64 host (what a child process inheriting it checks).
    assert find_host_lib_dir(root, machine="aarch64", system="Linux") == link
    assert (link / "libQnnHtpV75Skel.so").is_file()


def _fake_host(monkeypatch, tmp_path, machine: str, system: str, package: Path) -> list:
    """Point the set-up at a faked host and installation (empty library files: loading is recorded, not done)."""
    from optimum_qnn.sdk import finding, loading

    monkeypatch.setattr(loading.platform, "machine", lambda: machine)
    monkeypatch.setattr(loading.platform, "system", lambda: system)
    for module in (finding, loading):
        monkeypatch.setattr(module, "find_package_dir", {"onnxruntime_qnn": package}.get)
    monkeypatch.setattr(finding.importlib.metadata, "version", {"onnxruntime-qnn": "2.5.0"}.__getitem__)
    loaded = []
    monkeypatch.setattr(loading, "_load_globally", lambda lib_dir, host: loaded.append((lib_dir, host.libraries)))
    monkeypatch.setattr(loading, "read_build_id", lambda library: "v2.49.40.260810104044")
    monkeypatch.setenv("OPTIMUM_QNN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.setenv("ADSP_LIBRARY_PATH", "/vendor/dsp/cdsp")
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    return loaded


def test_set_up_on_an_aarch64_linux_host(tmp_path, monkeypatch):
    from optimum_qnn.sdk import loading

    package = _install_wheel(tmp_path / "site", AARCH64_WHEEL)
    loaded = _fake_host(monkeypatch, tmp_path, "aarch64", "Linux", package)

    found = loading._set_up()
    root = tmp_path / "cache" / "qnn-sdk" / cache_name("2.5.0", package)
    lib_dir = root / "lib" / "aarch64-oe-linux-gcc11.2"
    assert (found.root, found.lib_dir, found.htp_library) == (root, lib_dir, lib_dir / "libQnnHtp.so")
    assert found.source == "onnxruntime-qnn==2.5.0" and found.qairt_version == "2.49.40"
    assert os.environ["QNN_SDK_ROOT"] == str(root)
    assert loaded == [(lib_dir, ("libQnnHtp.so", "libQnnSystem.so"))]
    # FastRPC finds every skel in the package folder, put before the vendor's (older) skels; listed once.
    assert os.environ["ADSP_LIBRARY_PATH"] == f"{package.resolve()};/vendor/dsp/cdsp"
    assert os.environ["LD_LIBRARY_PATH"] == str(lib_dir)
    assert set(found.skel_dirs) == {68, 69, 73, 75, 79, 81}

    # A child process inheriting QNN_SDK_ROOT (and ADSP_LIBRARY_PATH) still reports the registry package, unchanged.
    again = loading._set_up()
    assert again == found and os.environ["ADSP_LIBRARY_PATH"] == f"{package.resolve()};/vendor/dsp/cdsp"


def test_set_up_on_windows_on_snapdragon(tmp_path, monkeypatch):
    from optimum_qnn.sdk import loading

    package = _install_wheel(tmp_path / "site", WIN_ARM64_WHEEL)
    loaded = _fake_host(monkeypatch, tmp_path, "ARM64", "Windows", package)
    dll_dirs = []
    monkeypatch.setattr(loading.os, "add_dll_directory", dll_dirs.append, raising=False)

    found = loading._set_up()
    # No cache link and no QNN_SDK_ROOT: the package folder itself, added to the DLL search path.
    assert (found.root, found.lib_dir, found.htp_library) == (package, package, package / "QnnHtp.dll")
    assert dll_dirs == [str(package)] and loaded == [(package, ("QnnHtp.dll", "QnnSystem.dll"))]
    assert "QNN_SDK_ROOT" not in os.environ and not (tmp_path / "cache").exists()
    assert os.environ["ADSP_LIBRARY_PATH"] == "/vendor/dsp/cdsp"  # Windows does not read it: left alone
    assert found.skel_dirs == {68: package, 73: package, 81: package}


def test_model_compiled_with_a_newer_qairt_is_refused_before_loading(qnn_sdk, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from executorch.runtime import Runtime

    from optimum_qnn.program import load_program

    def load_attempted():
        raise AssertionError("the program was loaded despite its newer QAIRT")

    monkeypatch.setattr(Runtime, "get", load_attempted)  # loading this fake file would crash the process
    pte = tmp_path / "model.pte"
    pte.write_bytes(b"\0" * 4 + b"ET12" + b"eh00" + b"\0" * 28)  # a header that passes check_pte_structure
    newer = f"v2.{int(qnn_sdk.build_id.split('.')[1]) + 1}.0.270101000000"
    manifest = SimpleNamespace(
        contract=SimpleNamespace(weight_sharing=False, shards=1), versions=SimpleNamespace(qairt_build_id=newer)
    )
    expected = f"compiled with QAIRT .* \\({newer}\\) but the QNN runtime here .*{qnn_sdk.build_id}"
    with pytest.raises(QnnSdkError, match=expected):
        load_program(pte, _facts(manifest))


# --- fresh processes --------------------------------------------------------------------------------------------


def test_importing_the_package_does_not_import_torch(run_python):
    code = (
        "import sys, optimum_qnn, optimum_qnn.sdk, optimum_qnn.doctor, optimum_qnn.__main__\n"
        "optimum_qnn.ensure_qnn_sdk\n"
        "assert 'torch' not in sys.modules and 'executorch' not in sys.modules, sorted(sys.modules)\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr


def test_building_a_quantizer_downloads_nothing(run_python, tmp_path):
    # Without QNN_SDK_ROOT, ExecuTorch's setup (on QnnQuantizer) downloads a QAIRT SDK and LLVM's libc++ from the
    # internet; the quantizer of this package sets the registry libraries up first, so its downloader never loads.
    code = (
        "import sys\n"
        "from optimum_qnn.quantization.pt2e import make_quantizer\n"
        "make_quantizer('16a4w_block')\n"
        "assert 'executorch.backends.qualcomm.scripts.download_qnn_sdk' not in sys.modules\n"
    )
    result = run_python("-c", code, env={"OPTIMUM_QNN_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr


def test_user_sdk_folder_is_honoured(run_python, qnn_sdk, tmp_path):
    # A fake QAIRT layout: the real libraries, symlinked one by one into lib/x86_64-linux-clang.
    lib_dir = tmp_path / "qairt" / "lib" / "x86_64-linux-clang"
    lib_dir.mkdir(parents=True)
    real = qnn_sdk.lib_dir.resolve()
    for lib in real.glob("lib*.so"):
        if lib.name != "libHtpPrepare.so":
            (lib_dir / lib.name).symlink_to(lib)
    # The registry libraries find their private libc++ at $ORIGIN/../onnxruntime_qnn.libs; a real SDK needs none.
    (lib_dir.parent / "onnxruntime_qnn.libs").symlink_to(real.parent / "onnxruntime_qnn.libs")
    cache = tmp_path / "cache"
    result = run_python("-c", _PRINT_SDK, env={"QNN_SDK_ROOT": str(tmp_path / "qairt"), "OPTIMUM_QNN_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["source"] == "QNN_SDK_ROOT"
    assert found["lib_dir"] == str(lib_dir)
    assert found["env_root"] == str(tmp_path / "qairt")
    assert found["build_id"].startswith(BUILD_ID_PREFIX)
    assert not cache.exists()  # no registry fallback was made


def test_inherited_root_of_registry_libraries_keeps_its_label(run_python, qnn_sdk, tmp_path):
    # A child of a process that set QNN_SDK_ROOT from onnxruntime-qnn inherits it: still the registry libraries.
    result = run_python("-c", _PRINT_SDK, env={"QNN_SDK_ROOT": str(qnn_sdk.root)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["source"] == qnn_sdk.source


def _facts(manifest):
    """The loading facts of a manifest stand-in that has only a contract and versions."""
    from optimum_qnn.program import ProgramFacts

    return ProgramFacts("0" * 64, ("kv_forward",), manifest.contract.weight_sharing, manifest.contract.shards,
                        manifest.versions.qairt_build_id)
