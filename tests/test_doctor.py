"""`python -m optimum_qnn doctor [PATH]` and the ExecuTorch QNN-backend check it shares with the runtime."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest

from optimum_qnn.config import Soc
from optimum_qnn.sdk.backend import (
    EXECUTORCH_QNN_BUILD,
    QnnBackendMissingError,
    qnn_backend_fix,
    qnn_backend_missing_message,
)
from tests.test_manifest import sample

BUILD_ID_PREFIX = "v2.49.40"

# Runs `doctor` in a fresh process whose ExecuTorch lists every registered backend but QnnBackend: the listing
# function of executorch's pybindings is wrapped, the libraries are the real ones.
_DOCTOR_WITHOUT_QNN_BACKEND = (
    "import sys\n"
    "from executorch.extension.pybindings import portable_lib\n"
    "real = portable_lib._get_registered_backend_names\n"
    "portable_lib._get_registered_backend_names = lambda: [b for b in real() if b != 'QnnBackend']\n"
    "from optimum_qnn.__main__ import main\n"
    "sys.exit(main(['doctor', *sys.argv[1:]]))\n"
)


@pytest.fixture
def artifacts(tmp_path):
    """Three variant folders (manifests only): the phone build, the emulator build, one from a newer QAIRT."""
    base = sample()
    for name, shared, build_id in [
        ("qnn/sm8650/16a8w-ctx64", True, "v2.49.40.260810104044"),
        ("emulator/qnn/sm8650/16a8w-ctx64", False, "v2.49.40.260810104044"),
        ("newer/qnn/sm8650/16a8w-ctx64", False, "v2.50.0.261101000000"),
    ]:
        folder = tmp_path / name
        folder.mkdir(parents=True)
        dataclasses.replace(
            base, contract=dataclasses.replace(base.contract, weight_sharing=shared),
            versions=dataclasses.replace(base.versions, qairt_build_id=build_id),
        ).write(folder)
    return tmp_path


def test_fix_for_each_host():
    assert qnn_backend_fix("x86_64", "Linux") == (
        "reinstall the registry's wheel, which has it: pip install --force-reinstall --no-deps executorch==1.5.1"
    )
    for machine, system in (("aarch64", "Linux"), ("ARM64", "Windows")):
        fix = qnn_backend_fix(machine, system)
        assert fix.startswith(f"the registry's executorch 1.5.1 for {machine} {system} is built without the QNN backend")
        assert fix.endswith(EXECUTORCH_QNN_BUILD)
    # The documented source build (ExecuTorch's "Building from Source": CMAKE_ARGS + install_executorch.sh).
    assert 'CMAKE_ARGS="-DEXECUTORCH_BUILD_QNN=ON -DQNN_SDK_ROOT=' in EXECUTORCH_QNN_BUILD
    assert EXECUTORCH_QNN_BUILD.endswith("./install_executorch.sh") and "-b v1.5.1" in EXECUTORCH_QNN_BUILD
    assert qnn_backend_missing_message(["XnnpackBackend", "OpenvinoBackend"], "aarch64", "Linux") == (
        "ExecuTorch's runtime in this Python has no QNN backend (registered backends: XnnpackBackend, OpenvinoBackend), "
        f"so it cannot run a QNN .pte. Fix: {qnn_backend_fix('aarch64', 'Linux')}"
    )


def test_doctor_reports_libraries_backend_and_runnable_artifacts(run_python, artifacts, tmp_path):
    cache = tmp_path / "cache"
    result = run_python("-m", "optimum_qnn", "doctor", str(artifacts), env={"OPTIMUM_QNN_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"build id      {BUILD_ID_PREFIX}." in out
    assert "source        onnxruntime-qnn==2.5.0" in out
    from optimum_qnn.sdk.finding import cache_name, find_package_dir

    root = cache / "qnn-sdk" / cache_name("2.5.0", find_package_dir("onnxruntime_qnn"))
    assert f"QNN_SDK_ROOT  {root}" in out
    assert "onnxruntime_qnn" in out  # the libraries' real folder
    assert "QNN backend  registered" in out and "QnnBackend" in out
    for soc in Soc:
        assert re.search(rf"\n  {soc.value} +{re.escape(soc.description)}\n", out), soc
    assert (root / "lib" / "x86_64-linux-clang" / "libQnnHtp.so").is_file()
    # This x86 host runs only the non-shared build of the QAIRT it has.
    assert f"Artifacts under {artifacts}: 1 of 3 can run here" in out
    verdict = _host_verdicts(out, artifacts)
    assert verdict["emulator/qnn/sm8650/16a8w-ctx64"] == "yes: on the x86 HTP emulator"
    assert verdict["qnn/sm8650/16a8w-ctx64"].startswith("no: weight-shared: the x86 HTP emulator cannot load it")
    assert verdict["newer/qnn/sm8650/16a8w-ctx64"].startswith(
        "no: This model was compiled with QAIRT 2.50 (v2.50.0.261101000000) but the QNN runtime here is QAIRT 2.49"
    )
    assert "set QNN_SDK_ROOT to a QAIRT 2.50+ SDK" in verdict["newer/qnn/sm8650/16a8w-ctx64"]
    # onnxruntime-qnn answers for its own libraries, by the same rules.
    ort = _ort_verdicts(out, artifacts)
    assert ort["emulator/qnn/sm8650/16a8w-ctx64"] == "yes: on the x86 HTP emulator through onnxruntime-qnn==2.5.0"
    assert ort["qnn/sm8650/16a8w-ctx64"].startswith("no: weight-shared: the x86 HTP emulator cannot load it")
    assert ort["newer/qnn/sm8650/16a8w-ctx64"].startswith("no: This model was compiled with QAIRT 2.50")
    assert "runtime  executorch: ExecuTorch here has its QNN backend" in out


def _answers(out: str, artifacts) -> dict[str, dict[str, str]]:
    """Variant -> backend -> "yes: ..." / "no: ..." from doctor's report."""
    section = out.split(f"Artifacts under {artifacts}: ")[1].split("\n\n")[0].splitlines()[1:]
    answers: dict[str, dict[str, str]] = {}
    for line in section:
        if not line.startswith("    "):
            variant = answers.setdefault(line.strip().split(" (")[0], {})
        else:
            backend, answer = line.strip().split(None, 1)
            variant[backend] = answer
    return answers


def _host_verdicts(out: str, artifacts) -> dict[str, str]:
    return {variant: backends["host:executorch"] for variant, backends in _answers(out, artifacts).items()}


def _ort_verdicts(out: str, artifacts) -> dict[str, str]:
    return {variant: backends["host:onnxruntime"] for variant, backends in _answers(out, artifacts).items()}


def test_doctor_without_the_qnn_backend_prints_the_fix(run_python, artifacts):
    result = run_python("-c", _DOCTOR_WITHOUT_QNN_BACKEND, str(artifacts))
    # onnxruntime-qnn stands in for the in-process runs: not a failure, but the fix is printed.
    assert result.returncode == 0, result.stdout + result.stderr
    assert "QNN backend  MISSING" in result.stdout
    assert "runtime  onnxruntime: ExecuTorch here has no QNN backend (registered: " in result.stdout
    assert f"Artifacts under {artifacts}: 1 of 3 can run here" in result.stdout
    assert result.stdout.count("no: this ExecuTorch has no QNN backend (the fix is below)") == 3
    assert _ort_verdicts(result.stdout, artifacts)["emulator/qnn/sm8650/16a8w-ctx64"].startswith("yes: ")
    answers = _answers(result.stdout, artifacts)
    assert all(a["runner"].startswith("no: ") for a in answers.values()), answers  # $QNN_LLAMA_RUNNER is unset
    assert "QNN backend: MISSING" in result.stderr
    assert "ExecuTorch's runtime in this Python has no QNN backend (registered backends: " in result.stderr
    assert f"Fix: {qnn_backend_fix('x86_64', 'Linux')}" in result.stderr


def test_on_a_board_without_the_python_qnn_backend_the_runner_backend_answers_per_variant(qnn_sdk, artifacts, tmp_path,
                                                                                      monkeypatch):
    """An aarch64 board whose executorch has no QNN backend, with ExecuTorch's runner built: each variant is judged
    by each backend; the runner can run the SM8650 ones (whatever the Python runtime lacks), another SoC's cannot."""
    from optimum_qnn import doctor
    from optimum_qnn.runtime.backends.availability import backend_checks

    runner = tmp_path / "build" / "qnn_llama_runner"
    runner.parent.mkdir()
    runner.write_text("#!/bin/sh\n")
    (runner.parent / "libqnn_executorch_backend.so").write_bytes(b"")
    monkeypatch.setenv("QNN_LLAMA_RUNNER", str(runner))
    checks = backend_checks(qnn_sdk, [], machine="aarch64", system="Linux", soc=Soc.SM8650)
    assert [c.name for c in checks] == ["host:executorch", "host:onnxruntime", "runner"]
    verdicts = {v.variant: v for v in doctor.judge_variants(artifacts, checks)}
    phone = verdicts["qnn/sm8650/16a8w-ctx64"]
    assert [(a.backend, a.runnable) for a in phone.answers] == [
        ("host:executorch", False), ("host:onnxruntime", True), ("runner", True)]
    assert str(runner) in phone.answers[2].reason and "no QNN backend" in phone.answers[0].reason
    newer = verdicts["newer/qnn/sm8650/16a8w-ctx64"]  # both load QAIRT 2.49 libraries: onnxruntime-qnn's, this machine's
    assert not newer.runnable and all("QAIRT 2.50" in a.reason for a in newer.answers[1:])
    other = backend_checks(qnn_sdk, [], machine="aarch64", system="Linux", soc=Soc.SM8750)
    for check in other[1:]:
        answer = check.judge(doctor_manifest(artifacts / "qnn/sm8650/16a8w-ctx64"))
        assert not answer.runnable and "export it with --soc SM8750" in answer.reason
    monkeypatch.delenv("QNN_LLAMA_RUNNER")
    answer = checks[2].judge(doctor_manifest(artifacts / "qnn/sm8650/16a8w-ctx64"))
    assert not answer.runnable and "No qnn_llama_runner given" in answer.reason


def doctor_manifest(folder):
    from optimum_qnn.artifacts.manifest import read_manifest

    return read_manifest(folder)


def test_doctor_refuses_a_wrong_sdk_folder(run_python, tmp_path):
    (tmp_path / "lib").mkdir()
    result = run_python("-m", "optimum_qnn", "doctor", env={"QNN_SDK_ROOT": str(tmp_path)})
    assert result.returncode == 1
    assert "QNN libraries: NOT USABLE" in result.stderr
    assert f"QNN_SDK_ROOT={tmp_path} does not look like a QAIRT SDK" in result.stderr
    assert f"expected {tmp_path}/lib/x86_64-linux-clang/{{libQnnHtp.so,libQnnSystem.so}}" in result.stderr


def test_model_loading_refuses_an_executorch_without_qnn(qnn_sdk, tmp_path, monkeypatch):
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    from optimum_qnn.program import load_program

    def load_attempted():
        raise AssertionError("the program was loaded by an ExecuTorch without QNN")

    monkeypatch.setattr(Runtime, "get", load_attempted)
    monkeypatch.setattr(portable_lib, "_get_registered_backend_names", lambda: ["XnnpackBackend"])
    pte = tmp_path / "model.pte"
    pte.write_bytes(b"\0" * 4 + b"ET12" + b"eh00" + b"\0" * 28)  # a header that passes check_pte_structure
    manifest = SimpleNamespace(
        contract=SimpleNamespace(weight_sharing=False, shards=1),
        versions=SimpleNamespace(qairt_build_id=qnn_sdk.build_id),
    )
    with pytest.raises(QnnBackendMissingError) as info:
        load_program(pte, _facts(manifest))
    assert str(info.value) == qnn_backend_missing_message(["XnnpackBackend"], "x86_64", "Linux")


def _facts(manifest):
    """The loading facts of a manifest stand-in that has only a contract and versions."""
    from optimum_qnn.program import ProgramFacts

    return ProgramFacts("0" * 64, ("kv_forward",), manifest.contract.weight_sharing, manifest.contract.shards,
                        manifest.versions.qairt_build_id)


def test_doctor_on_the_runtime_install_answers_through_onnxruntime(run_python, artifacts):
    """No torch, ExecuTorch or transformers importable: doctor still reports, and onnxruntime-qnn runs the variants."""
    from tests.test_runtime_install import run_without_exporter_stack

    result = run_without_exporter_stack(
        "from optimum_qnn.__main__ import main\n"
        f"sys.exit(main(['doctor', {str(artifacts)!r}]))\n", run_python)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "installed  no (the runtime install: in-process runs go through onnxruntime-qnn)" in result.stdout
    assert "runtime  onnxruntime: ExecuTorch is not installed (the runtime install)" in result.stdout
    answers = _answers(result.stdout, artifacts)
    assert answers["emulator/qnn/sm8650/16a8w-ctx64"]["host:onnxruntime"].startswith("yes: ")
    assert answers["emulator/qnn/sm8650/16a8w-ctx64"]["host:executorch"].startswith("no: ExecuTorch is not installed")
