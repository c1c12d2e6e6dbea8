"""optimum_qnn.sdk and the doctor command: finding, validating and loading the QNN libraries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from optimum_qnn.config import Soc
from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.sdk import (
    QnnSdkError,
    adsp_library_path,
    check_onnxruntime_qnn_version,
    check_runtime_can_load,
    find_host_lib_dir,
    host_lib_dir_patterns,
    parse_build_id,
    qairt_major_minor,
    registry_libraries,
    supported_socs,
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


# The file layout of the qnnruntime 2.48.0.2 wheel (aarch64 Linux only), as empty files.
QNNRUNTIME_VERSION = "2.48.0.2"
QNNRUNTIME_SKEL_ARCHS = (68, 69, 73, 75, 79, 81)
_QNNRUNTIME_FILES = (
    "__init__.py",
    "_qnnruntime.cpython-311-aarch64-linux-gnu.so",
    "session.py",
    *(
        f".libs/{name}"
        for name in (
            "libQnnCpu.so",
            "libQnnHtp.so",
            "libQnnHtpPrepare.so",
            "libQnnSystem.so",
            "libcalculator.so",
            "libhta_hexagon_runtime_qnn.so",
        )
    ),
    *(f".libs/libQnnHtpV{arch}{kind}Stub.so" for arch in QNNRUNTIME_SKEL_ARCHS for kind in ("", "Calculator")),
    *(
        f".libs/hexagon-v{arch}/unsigned/{name}"
        for arch in QNNRUNTIME_SKEL_ARCHS
        for name in (f"libQnnHtpV{arch}Skel.so", "libCalculator_skel.so")
    ),
    ".libs/hexagon-v73/unsigned/libqnnhtpv7x.cat",
    ".libs/hexagon-v81/unsigned/libqnnhtpv7x.cat",
    ".libs/hexagon-v66/unsigned/libCalculator_skel.so",
)


def _qnnruntime_package(site: Path, without: tuple[str, ...] = ()) -> Path:
    """`site/qnnruntime/` laid out like the installed wheel (empty files), minus the paths in `without`."""
    package = site / "qnnruntime"
    for relative in _QNNRUNTIME_FILES:
        if relative not in without:
            (package / relative).parent.mkdir(parents=True, exist_ok=True)
            (package / relative).write_bytes(b"")
    return package


def _installed(packages: dict[str, Path], versions: dict[str, str]):
    """`find_package` and `version_of` stand-ins for `registry_libraries`: only these packages are installed."""
    return packages.get, versions.__getitem__


# --- pure functions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "expected"),
    [("x86_64", ("x86_64-linux-clang",)), ("AMD64", ("x86_64-linux-clang",)), ("aarch64", ("aarch64-oe-linux-gcc*",))],
)
def test_host_lib_dir_patterns(machine, expected):
    assert host_lib_dir_patterns(machine, "Linux") == expected


@pytest.mark.parametrize(("machine", "system", "message"), [("riscv64", "Linux", "riscv64"), ("x86_64", "Darwin", "Darwin")])
def test_host_lib_dir_patterns_refuses_unknown_hosts(machine, system, message):
    with pytest.raises(QnnSdkError, match=message):
        host_lib_dir_patterns(machine, system)


def test_aarch64_host_picks_newest_toolchain_folder(tmp_path):
    _make_libs(tmp_path / "lib" / "aarch64-oe-linux-gcc9.3")
    newest = _make_libs(tmp_path / "lib" / "aarch64-oe-linux-gcc11.2")
    _make_libs(tmp_path / "lib" / "x86_64-linux-clang")
    assert find_host_lib_dir(tmp_path, machine="aarch64", system="Linux") == newest
    assert find_host_lib_dir(tmp_path, machine="x86_64", system="Linux") == tmp_path / "lib" / "x86_64-linux-clang"


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
def test_aarch64_linux_resolves_to_qnnruntime(tmp_path, machine):
    package = _qnnruntime_package(tmp_path / "site")
    asked = []
    find, version_of = _installed({"qnnruntime": package}, {"qnnruntime": QNNRUNTIME_VERSION})

    def find_package(name):
        asked.append(name)
        return find(name)

    libs = registry_libraries(machine, "Linux", find_package=find_package, version_of=version_of)
    assert asked == ["qnnruntime"]
    assert libs.dist == "qnnruntime" and libs.version == QNNRUNTIME_VERSION
    assert libs.source == "qnnruntime==2.48.0.2"
    assert libs.lib_source == package / ".libs"
    assert libs.host_dir == "aarch64-oe-linux-gcc11.2"
    assert libs.cache_name == "qnnruntime-2.48.0.2"
    # Only the folders holding an HTP skel: hexagon-v66 holds a calculator skel only.
    assert dict(libs.skel_dirs) == {
        arch: package / ".libs" / f"hexagon-v{arch}" / "unsigned" for arch in QNNRUNTIME_SKEL_ARCHS
    }
    # The exposed host folder is one find_host_lib_dir looks for on aarch64 (an inherited QNN_SDK_ROOT).
    assert [libs.host_dir] == [p.name for p in _glob_host_dir(tmp_path, libs.host_dir, "aarch64")]


def _glob_host_dir(tmp_path: Path, host_dir: str, machine: str) -> list[Path]:
    (tmp_path / "probe" / "lib" / host_dir).mkdir(parents=True)
    return [d for p in host_lib_dir_patterns(machine, "Linux") for d in (tmp_path / "probe" / "lib").glob(p)]


def test_x86_64_linux_still_resolves_to_onnxruntime_qnn(tmp_path):
    ort = _make_libs(tmp_path / "site" / "onnxruntime_qnn")
    qnnruntime = _qnnruntime_package(tmp_path / "site")
    find, version_of = _installed(
        {"onnxruntime_qnn": ort, "qnnruntime": qnnruntime},
        {"onnxruntime-qnn": "2.5.0", "qnnruntime": QNNRUNTIME_VERSION},
    )
    libs = registry_libraries("x86_64", "Linux", find_package=find, version_of=version_of)
    assert (libs.dist, libs.version, libs.source) == ("onnxruntime-qnn", "2.5.0", "onnxruntime-qnn==2.5.0")
    assert libs.lib_source == ort
    assert (libs.host_dir, libs.cache_name) == ("x86_64-linux-clang", "2.5.0")  # the cache path of before
    assert dict(libs.skel_dirs) == {}


def test_x86_64_ignores_qnnruntime_and_still_pins_onnxruntime_qnn(tmp_path):
    find, version_of = _installed({"qnnruntime": _qnnruntime_package(tmp_path)}, {"qnnruntime": QNNRUNTIME_VERSION})
    with pytest.raises(QnnSdkError) as info:
        registry_libraries("x86_64", "Linux", find_package=find, version_of=version_of)
    assert str(info.value) == (
        "No QNN libraries found: QNN_SDK_ROOT is unset and onnxruntime-qnn is not installed. "
        "Fix: pip install onnxruntime-qnn==2.5.0, or set QNN_SDK_ROOT to a QAIRT SDK."
    )
    find, version_of = _installed({"onnxruntime_qnn": _make_libs(tmp_path / "ort")}, {"onnxruntime-qnn": "2.7.0"})
    with pytest.raises(QnnSdkError, match="onnxruntime-qnn==2.5.0 is required; found 2.7.0"):
        registry_libraries("x86_64", "Linux", find_package=find, version_of=version_of)


def test_aarch64_without_qnnruntime_says_what_to_do(tmp_path):
    # onnxruntime-qnn's x86_64 libraries are no use on aarch64, installed or not.
    find, version_of = _installed({"onnxruntime_qnn": _make_libs(tmp_path / "ort")}, {"onnxruntime-qnn": "2.5.0"})
    with pytest.raises(QnnSdkError) as info:
        registry_libraries("aarch64", "Linux", find_package=find, version_of=version_of)
    assert str(info.value) == (
        "No QNN libraries found for this aarch64 Linux host: QNN_SDK_ROOT is unset and qnnruntime is not "
        "installed. Fix: pip install qnnruntime, or set QNN_SDK_ROOT to a QAIRT SDK."
    )


@pytest.mark.parametrize("missing", ["libQnnHtp.so", "libQnnSystem.so"])
def test_qnnruntime_missing_a_library(tmp_path, missing):
    package = _qnnruntime_package(tmp_path, without=(f".libs/{missing}",))
    find, version_of = _installed({"qnnruntime": package}, {"qnnruntime": QNNRUNTIME_VERSION})
    with pytest.raises(QnnSdkError) as info:
        registry_libraries("aarch64", "Linux", find_package=find, version_of=version_of)
    assert str(info.value) == (
        f"qnnruntime==2.48.0.2 lacks {package / '.libs' / missing}: reinstall with "
        "pip install --force-reinstall qnnruntime==2.48.0.2, or set QNN_SDK_ROOT to a QAIRT SDK."
    )


def test_qnnruntime_without_htp_skels(tmp_path):
    skels = tuple(f".libs/hexagon-v{arch}/unsigned/libQnnHtpV{arch}Skel.so" for arch in QNNRUNTIME_SKEL_ARCHS)
    package = _qnnruntime_package(tmp_path, without=skels)
    find, version_of = _installed({"qnnruntime": package}, {"qnnruntime": QNNRUNTIME_VERSION})
    with pytest.raises(QnnSdkError, match=r"qnnruntime==2\.48\.0\.2 lacks the Hexagon skel libraries") as info:
        registry_libraries("aarch64", "Linux", find_package=find, version_of=version_of)
    assert "pip install --force-reinstall qnnruntime==2.48.0.2" in str(info.value)


@pytest.mark.parametrize(("machine", "system"), [("riscv64", "Linux"), ("x86_64", "Darwin"), ("arm64", "Darwin")])
def test_host_no_registry_package_covers(tmp_path, machine, system):
    package = _qnnruntime_package(tmp_path)
    find, version_of = _installed({"qnnruntime": package, "onnxruntime_qnn": package}, {})
    with pytest.raises(QnnSdkError) as info:
        registry_libraries(machine, system, find_package=find, version_of=version_of)
    assert str(info.value) == (
        f"No QNN libraries for this {machine} {system} host: optimum-qnn runs on x86_64 Linux (pip install "
        "onnxruntime-qnn==2.5.0) or aarch64 Linux (pip install qnnruntime), or with QNN_SDK_ROOT set to a QAIRT "
        "SDK for a Linux host."
    )


def test_adsp_library_path_puts_the_skel_folders_first():
    skels = [Path("/site/qnnruntime/.libs/hexagon-v73/unsigned"), Path("/site/qnnruntime/.libs/hexagon-v75/unsigned")]
    ours = "/site/qnnruntime/.libs/hexagon-v73/unsigned;/site/qnnruntime/.libs/hexagon-v75/unsigned"
    assert adsp_library_path(None, skels) == ours
    assert adsp_library_path("", skels) == ours
    # The user's entries follow, in their order, without empties or repeats (a second set-up adds nothing).
    mixed = adsp_library_path("/vendor/dsp/cdsp;;/usr/lib/rfsa/adsp;", skels)
    assert mixed == f"{ours};/vendor/dsp/cdsp;/usr/lib/rfsa/adsp"
    again = adsp_library_path(f"{ours};/vendor/dsp/cdsp", skels)
    assert again == f"{ours};/vendor/dsp/cdsp" and adsp_library_path(again, skels) == again
    assert adsp_library_path("/dsp;/site/qnnruntime/.libs/hexagon-v75/unsigned", skels) == f"{ours};/dsp"


def test_qairt_major_minor():
    assert qairt_major_minor("v2.49.40.260810104044") == (2, 49)
    assert qairt_major_minor("2.48.0") == (2, 48)
    assert qairt_major_minor("v3.0") == (3, 0)
    for bad in ("", "qnn-2.49", "v2", "2.49x"):
        with pytest.raises(QnnSdkError, match="is not a QAIRT build id"):
            qairt_major_minor(bad)


def test_newer_artifact_refused_by_older_runtime():
    with pytest.raises(QnnSdkError) as info:
        check_runtime_can_load("v2.49.40.260810104044", "v2.48.0.250915123456", runtime_source="qnnruntime==2.48.0.2")
    assert isinstance(info.value, OptimumQnnError)
    assert str(info.value) == (
        "This model was compiled with QAIRT 2.49 (v2.49.40.260810104044) but the QNN runtime here is QAIRT 2.48 "
        "(v2.48.0.250915123456, from qnnruntime==2.48.0.2); QNN context binaries load only on the QAIRT version "
        "that compiled them or a newer one. Fix: use QNN libraries of QAIRT 2.49 or newer (pip install "
        "'qnnruntime>=2.49' on an aarch64 device, or set QNN_SDK_ROOT to a QAIRT 2.49+ SDK), or re-export the "
        "model with QAIRT 2.48 (QNN_SDK_ROOT pointing at that SDK during the export)."
    )
    with pytest.raises(QnnSdkError, match=r"compiled with QAIRT 2\.10 .* QNN runtime here is QAIRT 2\.9 \(v2\.9\.1\)"):
        check_runtime_can_load("v2.10.0", "v2.9.1")  # compared as numbers, not strings


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
    from optimum_qnn.sdk import _find_ort_qnn_dir, ensure_qnn_sdk

    assert ensure_qnn_sdk() is qnn_sdk  # cached
    assert qnn_sdk.build_id.startswith(BUILD_ID_PREFIX)
    assert qnn_sdk.qairt_version == "2.49.40"
    # The API's answer and the bytes agree.
    assert parse_build_id(qnn_sdk.htp_library.read_bytes()) == qnn_sdk.build_id
    if qnn_sdk.source == "onnxruntime-qnn==2.5.0":
        assert qnn_sdk.lib_dir.resolve() == _find_ort_qnn_dir().resolve()
    assert os.environ["QNN_SDK_ROOT"] == str(qnn_sdk.root)
    assert str(qnn_sdk.lib_dir) in os.environ["LD_LIBRARY_PATH"].split(os.pathsep)


def test_cache_link_is_created_and_repointed(tmp_path, monkeypatch):
    from optimum_qnn.sdk import _link_cache_root

    monkeypatch.setenv("OPTIMUM_QNN_CACHE", str(tmp_path / "cache"))
    old, new = tmp_path / "old_venv", tmp_path / "new_venv"
    old.mkdir(), new.mkdir()
    root = _link_cache_root(old, "9.9.9")
    link = root / "lib" / "x86_64-linux-clang"
    assert root == tmp_path / "cache" / "qnn-sdk" / "9.9.9" and link.resolve() == old
    assert _link_cache_root(new, "9.9.9") == root and link.resolve() == new
    assert [p.name for p in link.parent.iterdir()] == ["x86_64-linux-clang"]  # no temporary link left behind


def test_cache_link_for_the_aarch64_host_folder(tmp_path, monkeypatch):
    from optimum_qnn.sdk import _link_cache_root

    monkeypatch.setenv("OPTIMUM_QNN_CACHE", str(tmp_path / "cache"))
    package = _qnnruntime_package(tmp_path / "site")
    find, version_of = _installed({"qnnruntime": package}, {"qnnruntime": QNNRUNTIME_VERSION})
    libs = registry_libraries("aarch64", "Linux", find_package=find, version_of=version_of)
    root = _link_cache_root(libs.lib_source, libs.cache_name, libs.host_dir)
    link = root / "lib" / "aarch64-oe-linux-gcc11.2"
    assert root == tmp_path / "cache" / "qnn-sdk" / "qnnruntime-2.48.0.2"
    assert link.is_symlink() and link.resolve() == package / ".libs"
    assert _link_cache_root(libs.lib_source, libs.cache_name, libs.host_dir) == root  # idempotent
    assert [p.name for p in link.parent.iterdir()] == ["aarch64-oe-linux-gcc11.2"]
    # The root is a valid QAIRT layout for an aarch64 host (what a child process inheriting it checks).
    assert find_host_lib_dir(root, machine="aarch64", system="Linux") == link
    assert (link / "hexagon-v75" / "unsigned" / "libQnnHtpV75Skel.so").is_file()


def test_set_up_on_an_aarch64_host(tmp_path, monkeypatch):
    """`_set_up` wired to qnnruntime on a faked aarch64 host (the libraries are empty files: loading is faked)."""
    from optimum_qnn import sdk

    package = _qnnruntime_package(tmp_path / "site")
    monkeypatch.setattr(sdk.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(sdk.platform, "system", lambda: "Linux")
    monkeypatch.setattr(sdk, "_find_package_dir", {"qnnruntime": package}.get)
    monkeypatch.setattr(sdk.importlib.metadata, "version", {"qnnruntime": QNNRUNTIME_VERSION}.__getitem__)
    loaded = []
    monkeypatch.setattr(sdk, "_load_globally", loaded.append)
    monkeypatch.setattr(sdk, "read_build_id", lambda library: "v2.48.0.250915123456")
    monkeypatch.setenv("OPTIMUM_QNN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.setenv("ADSP_LIBRARY_PATH", "/vendor/dsp/cdsp")
    monkeypatch.setenv("LD_LIBRARY_PATH", "")

    found = sdk._set_up()
    root = tmp_path / "cache" / "qnn-sdk" / "qnnruntime-2.48.0.2"
    lib_dir = root / "lib" / "aarch64-oe-linux-gcc11.2"
    assert (found.root, found.lib_dir, found.htp_library) == (root, lib_dir, lib_dir / "libQnnHtp.so")
    assert found.source == "qnnruntime==2.48.0.2" and found.build_id == "v2.48.0.250915123456"
    assert os.environ["QNN_SDK_ROOT"] == str(root)
    assert loaded == [lib_dir]
    skels = [str((package / ".libs" / f"hexagon-v{arch}" / "unsigned").resolve()) for arch in QNNRUNTIME_SKEL_ARCHS]
    assert os.environ["ADSP_LIBRARY_PATH"] == ";".join([*skels, "/vendor/dsp/cdsp"])
    assert os.environ["LD_LIBRARY_PATH"] == str(lib_dir)

    # A child process inheriting QNN_SDK_ROOT (and ADSP_LIBRARY_PATH) still reports qnnruntime, unchanged.
    again = sdk._set_up()
    assert again == found and os.environ["ADSP_LIBRARY_PATH"] == ";".join([*skels, "/vendor/dsp/cdsp"])


def test_model_compiled_with_a_newer_qairt_is_refused_before_loading(qnn_sdk, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from executorch.runtime import Runtime

    from optimum_qnn.modeling import _load_program

    def load_attempted():
        raise AssertionError("the program was loaded despite its newer QAIRT")

    monkeypatch.setattr(Runtime, "get", load_attempted)  # loading this fake file would crash the process
    pte = tmp_path / "model.pte"
    pte.write_bytes(b"\0" * 4 + b"ET12" + b"eh00" + b"\0" * 28)  # a header that passes check_pte_structure
    newer = f"v2.{int(qnn_sdk.build_id.split('.')[1]) + 1}.0.270101000000"
    manifest = SimpleNamespace(
        contract=SimpleNamespace(weight_sharing=False), versions=SimpleNamespace(qairt_build_id=newer)
    )
    expected = f"compiled with QAIRT .* \\({newer}\\) but the QNN runtime here .*{qnn_sdk.build_id}"
    with pytest.raises(QnnSdkError, match=expected):
        _load_program(pte, manifest)


# --- fresh processes --------------------------------------------------------------------------------------------


def test_importing_the_package_does_not_import_torch(run_python):
    code = (
        "import sys, optimum_qnn, optimum_qnn.sdk, optimum_qnn.doctor, optimum_qnn.__main__\n"
        "optimum_qnn.ensure_qnn_sdk\n"
        "assert 'torch' not in sys.modules and 'executorch' not in sys.modules, sorted(sys.modules)\n"
    )
    result = run_python("-c", code)
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


def test_doctor_reports_build_id_and_source(run_python, tmp_path):
    cache = tmp_path / "cache"
    result = run_python("-m", "optimum_qnn", "doctor", env={"OPTIMUM_QNN_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"build id      {BUILD_ID_PREFIX}." in out
    assert "source        onnxruntime-qnn==2.5.0" in out
    assert f"QNN_SDK_ROOT  {cache / 'qnn-sdk' / '2.5.0'}" in out
    assert "onnxruntime_qnn" in out  # the libraries' real folder
    for soc in Soc:
        assert f"{soc.value}  HTP v{soc.htp_arch}" in out
    assert (cache / "qnn-sdk" / "2.5.0" / "lib" / "x86_64-linux-clang" / "libQnnHtp.so").is_file()


def test_doctor_refuses_a_wrong_sdk_folder(run_python, tmp_path):
    (tmp_path / "lib").mkdir()
    result = run_python("-m", "optimum_qnn", "doctor", env={"QNN_SDK_ROOT": str(tmp_path)})
    assert result.returncode == 1
    assert "QNN libraries: NOT USABLE" in result.stderr
    assert f"QNN_SDK_ROOT={tmp_path} does not look like a QAIRT SDK" in result.stderr
    assert f"expected {tmp_path}/lib/x86_64-linux-clang/{{libQnnHtp.so,libQnnSystem.so}}" in result.stderr
