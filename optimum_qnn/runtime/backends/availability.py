"""Which backend on this machine can run an exported variant, and what is missing for the others: `doctor`'s answer.

Why a list of backends: a variant that ExecuTorch's Python runtime cannot run here (an aarch64 board whose executorch
wheel has no QNN backend) may still run on ExecuTorch's C++ runner (``--device runner``), so a single yes/no was
wrong. Each `BackendCheck` answers for one backend, "can run" or "why not"; a new backend (an onnxruntime one) is one
more class in `backend_checks`' list (`OnnxRuntimeCheck` is one). The checks read files and versions only: nothing is loaded or run.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from optimum_qnn.program import is_emulator_host
from optimum_qnn.sdk import QnnSdk, QnnSdkError, check_runtime_can_load
from optimum_qnn.sdk.backend import QNN_BACKEND, is_installed


@dataclass(frozen=True)
class Answer:
    """One backend's answer for one variant."""

    backend: str
    runnable: bool
    reason: str


class BackendCheck(Protocol):
    name: str

    def judge(self, manifest: Any, folder: Any = None) -> Answer: ...


def _target_problem(manifest: Any, machine: str, soc: Any) -> str | None:
    """Why this machine's HTP (or its x86 emulator) cannot run the variant, or None."""
    if is_emulator_host(machine):
        if manifest.contract.weight_sharing:
            return ("weight-shared: the x86 HTP emulator cannot load it (it is the phone build; re-export with "
                    "--no-weight-sharing to run it here)")
        return None
    if soc is not None and manifest.target.soc != soc.value:
        return (f"compiled for {manifest.target.soc} (HTP v{manifest.target.htp_arch}), and this host is a {soc.label}: "
                f"export it with --soc {soc.value}")
    return None


def _qairt_problem(manifest: Any, sdk: QnnSdk | None) -> str | None:
    if sdk is None:
        return "no usable QNN libraries here (see 'QNN libraries' above)"
    try:
        check_runtime_can_load(manifest.versions.qairt_build_id, sdk.build_id, runtime_source=sdk.source)
    except QnnSdkError as e:
        return str(e)
    return None


def _where(machine: str) -> str:
    return "on the x86 HTP emulator" if is_emulator_host(machine) else f"on this {machine} host's HTP"


@dataclass(frozen=True)
class HostCheck:
    """``--device host:executorch``: ExecuTorch's Python runtime in this process, with its QNN backend."""

    sdk: QnnSdk | None
    backends: tuple[str, ...] | None  # None: ExecuTorch is not installed
    machine: str
    soc: Any = None
    name: str = "host:executorch"

    def judge(self, manifest: Any, folder: Any = None) -> Answer:
        if self.backends is None:
            return Answer(self.name, False, "ExecuTorch is not installed (pip install \"optimum-qnn[export]\" adds it)")
        if QNN_BACKEND not in self.backends:
            return Answer(self.name, False, "this ExecuTorch has no QNN backend (the fix is below)")
        why = _target_problem(manifest, self.machine, self.soc) or _qairt_problem(manifest, self.sdk)
        return Answer(self.name, why is None, why or _where(self.machine))


@dataclass(frozen=True)
class OnnxRuntimeCheck:
    """``--device host:onnxruntime``: onnxruntime-qnn in this process (its own QNN libraries, no ExecuTorch)."""

    machine: str
    soc: Any = None
    name: str = "host:onnxruntime"

    def judge(self, manifest: Any, folder: Any = None) -> Answer:
        status = onnxruntime_qnn_status()
        if isinstance(status, str):
            return Answer(self.name, False, status)
        build_id, source = status
        why = _target_problem(manifest, self.machine, self.soc)
        if why is None:
            try:
                check_runtime_can_load(manifest.versions.qairt_build_id, build_id, runtime_source=source)
            except QnnSdkError as e:
                why = str(e)
        program = getattr(manifest, "program", None)  # a manifest read from disk has it
        if why is None and folder is not None and program is not None and (Path(folder) / program.path).is_file():
            # The CPU side of the program, read from the file (no QNN load): an op it has no kernel for is named.
            from optimum_qnn.artifacts.manifest import resolve_inside
            from optimum_qnn.errors import OptimumQnnError
            from optimum_qnn.runtime.backends.onnxruntime.program import check_program_file

            try:
                check_program_file(resolve_inside(folder, manifest.program.path))
            except (OptimumQnnError, OSError) as e:
                why = str(e)
        return Answer(self.name, why is None, why or f"{_where(self.machine)} through {source}")


def onnxruntime_qnn_status() -> tuple[str, str] | str:
    """(QAIRT build id, package) of this machine's onnxruntime-qnn, or why it cannot serve here."""
    if not (is_installed("onnxruntime_qnn") and is_installed("onnxruntime")):
        return "onnxruntime-qnn is not installed: pip install onnxruntime-qnn==2.5.0 (it comes with optimum-qnn)"
    from optimum_qnn.runtime.backends.device import DeviceError
    from optimum_qnn.runtime.backends.onnxruntime.backend import runtime_build_id

    try:
        return runtime_build_id()
    except (DeviceError, OSError) as e:
        return f"onnxruntime-qnn's HTP library cannot be read: {e}"


@dataclass(frozen=True)
class RunnerCheck:
    """``--device runner``: ExecuTorch's C++ ``qnn_llama_runner`` on this machine ($QNN_LLAMA_RUNNER)."""

    sdk: QnnSdk | None
    machine: str
    system: str
    soc: Any = None
    runner: str | None = None
    name: str = "runner"

    def judge(self, manifest: Any, folder: Any = None) -> Answer:
        from optimum_qnn.runtime.backends.bundle import find_backend_library, find_runner
        from optimum_qnn.runtime.backends.device import DeviceError

        if self.system == "Windows":
            return Answer(self.name, False, "not supported on Windows yet (the runner is driven through POSIX paths)")
        why = _target_problem(manifest, self.machine, self.soc) or _qairt_problem(manifest, self.sdk)
        if why:
            return Answer(self.name, False, why)
        try:
            found = find_runner(self.runner)
            find_backend_library(found)
        except DeviceError as e:
            return Answer(self.name, False, str(e))
        return Answer(self.name, True, f"{found} {_where(self.machine)}")


@dataclass(frozen=True)
class AdbCheck:
    """``--device adb``: the runner on the phone ``doctor --adb`` named (its SoC read with getprop)."""

    soc: Any
    serial: str
    runner: str | None = None
    name: str = "adb"

    def judge(self, manifest: Any, folder: Any = None) -> Answer:
        from optimum_qnn.runtime.backends.bundle import find_runner
        from optimum_qnn.runtime.backends.device import DeviceError

        if self.soc is None:
            return Answer(self.name, False, f"the phone {self.serial} does not say its SoC (getprop ro.soc.model)")
        if manifest.target.soc != self.soc.value:
            return Answer(self.name, False, f"compiled for {manifest.target.soc}, and the phone {self.serial} is a "
                          f"{self.soc.label}: export it with --soc {self.soc.value}")
        try:
            found = find_runner(self.runner)
        except DeviceError as e:
            return Answer(self.name, False, str(e))
        return Answer(self.name, True, f"{found} on the phone {self.serial}")


def backend_checks(sdk: QnnSdk | None, backends: list[str] | None, *, machine: str | None = None, system: str | None = None,
                   soc: Any = None, adb: tuple[str, Any] | None = None) -> list[BackendCheck]:
    """The backends of this machine (host, runner) or, with ``adb`` (serial, its SoC), of that phone."""
    machine = machine or platform.machine()
    system = system or platform.system()
    if adb is not None:
        return [AdbCheck(adb[1], adb[0])]
    return [HostCheck(sdk, None if backends is None else tuple(backends), machine, soc),
            OnnxRuntimeCheck(machine, soc), RunnerCheck(sdk, machine, system, soc)]
