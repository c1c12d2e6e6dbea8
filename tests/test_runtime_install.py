"""The runtime install (`pip install optimum-qnn`, no extras): its requirements resolve to registry wheels on every
host people deploy to, and nothing a running command imports needs torch, ExecuTorch or transformers.

The resolution is pip's own (`pip install --dry-run --only-binary=:all: --platform ... --report`, the same resolver
and index as `pip download`, without fetching the wheels): Windows on Snapdragon (win_arm64, Python 3.12: PyYAML,
which huggingface_hub needs, has no cp311 win_arm64 wheel), Linux aarch64 boards (onnxruntime-qnn's wheel is
manylinux_2_34: glibc 2.34 or newer) and x86_64 (manylinux_2_35: glibc 2.35 or newer).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO_ROOT

HOSTS = {
    "win_arm64": ("3.12", ["win_arm64"], "win_arm64"),
    "linux_aarch64": ("3.11", ["manylinux_2_34_aarch64", "manylinux_2_28_aarch64", "manylinux_2_17_aarch64",
                               "manylinux2014_aarch64"], "manylinux_2_34_aarch64"),
    "linux_x86_64": ("3.11", ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                              "manylinux2014_x86_64"], "x86_64"),
}
EXPORT_ONLY = ("torch", "executorch", "torchao", "transformers", "optimum")


def runtime_requirements() -> list[str]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_the_runtime_install_leaves_the_exporter_stack_to_the_export_extra():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    names = {r.split("=")[0].split("<")[0].split(">")[0].strip().lower() for r in project["dependencies"]}
    assert not names & set(EXPORT_ONLY), names
    export = " ".join(project["optional-dependencies"]["export"])
    assert all(name in export for name in ("torch==", "executorch==", "transformers==")), export


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_runtime_requirements_resolve_to_wheels(host, tmp_path):
    python, platforms, onnxruntime_qnn_tag = HOSTS[host]
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--only-binary=:all:",
           "--python-version", python, "--target", str(tmp_path / "t"), "--report", str(report)]
    cmd += [arg for p in platforms for arg in ("--platform", p)]
    proc = subprocess.run(cmd + runtime_requirements(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = {item["metadata"]["name"].lower(): item["download_info"]["url"].rsplit("/", 1)[-1]
              for item in json.loads(report.read_text())["install"]}
    assert onnxruntime_qnn_tag in wheels["onnxruntime-qnn"], wheels["onnxruntime-qnn"]
    assert all(w.endswith(".whl") for w in wheels.values()), wheels
    assert not set(wheels) & set(EXPORT_ONLY), sorted(wheels)


_BLOCKER = """
import importlib.abc, importlib.util, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: the runtime install has none)", name=name)
sys.meta_path.insert(0, Block())
"""


def run_without_exporter_stack(code: str, run_python) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where torch, executorch, transformers and torchao cannot be imported."""
    return run_python("-c", _BLOCKER.format(blocked=("torch", "executorch", "transformers", "torchao")) + code)


def test_running_commands_import_without_torch(run_python):
    modules = ["optimum_qnn", "optimum_qnn.runtime.modeling", "optimum_qnn.runtime.chat", "optimum_qnn.runtime.tokenizer",
               "optimum_qnn.runtime.backends.host", "optimum_qnn.runtime.backends.onnxruntime.backend",
               "optimum_qnn.runtime.backends.runner", "optimum_qnn.runtime.server.app", "optimum_qnn.doctor",
               "optimum_qnn.artifacts.hub", "optimum_qnn.artifacts.inspection", "optimum_qnn.images", "optimum_qnn.__main__"]
    proc = run_without_exporter_stack(
        "import importlib\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print('imported', len(sys.modules))", run_python)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]


def test_export_on_the_runtime_install_says_which_command_installs_it(run_python, tmp_path):
    proc = run_without_exporter_stack(
        "import runpy; sys.argv = ['optimum_qnn', 'export', '--model', 'm', '--output', %r, '--soc', 'SM8650']\n"
        "runpy.run_module('optimum_qnn', run_name='__main__')" % str(tmp_path / "out"), run_python)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert 'pip install "optimum-qnn[export]"' in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
