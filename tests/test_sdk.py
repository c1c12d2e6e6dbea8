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
    check_onnxruntime_qnn_version,
    find_host_lib_dir,
    host_lib_dir_patterns,
    parse_build_id,
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
