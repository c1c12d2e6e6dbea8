"""Which backend on this machine can run an exported variant, and what is missing for the others: `doctor`'s answer.

Why a list of backends: a variant that ExecuTorch's Python runtime cannot run here (an aarch64 board whose executorch
wheel has no QNN backend) may still run on ExecuTorch's C++ runner (``--device runner``), so a single yes/no was
wrong. Each `BackendCheck` answers for one backend, "can run" or "why not"; a new backend (an onnxruntime one) is one
more class in `backend_checks`' list. The checks read files and versions only: nothing is loaded or run.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any, Protocol

from optimum_qnn.program import is_emulator_host
from optimum_qnn.sdk import QnnSdk, QnnSdkError, check_runtime_can_load
from optimum_qnn.sdk.backend import QNN_BACKEND


@dataclass(frozen=True)
class Answer:
    """One backend's answer for one variant."""

    backend: str
    runnable: bool
    reason: str


class BackendCheck(Protocol):
    name: str

    def judge(self, manifest: Any) -> Answer: ...


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
    """``--device host``: ExecuTorch's Python runtime in this process, with its QNN backend."""

    sdk: QnnSdk | None
    backends: tuple[str, ...]
    machine: str
    soc: Any = None
    name: str = "host"

    def judge(self, manifest: Any) -> Answer:
        if QNN_BACKEND not in self.backends:
            return Answer(self.name, False, "this ExecuTorch has no QNN backend (the fix is below)")
        why = _target_problem(manifest, self.machine, self.soc) or _qairt_problem(manifest, self.sdk)
        return Answer(self.name, why is None, why or _where(self.machine))


@dataclass(frozen=True)
class RunnerCheck:
    """``--device runner``: ExecuTorch's C++ ``qnn_llama_runner`` on this machine ($QNN_LLAMA_RUNNER)."""

    sdk: QnnSdk | None
    machine: str
    system: str
    soc: Any = None
    runner: str | None = None
    name: str = "runner"

    def judge(self, manifest: Any) -> Answer:
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

    def judge(self, manifest: Any) -> Answer:
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


def backend_checks(sdk: QnnSdk | None, backends: list[str], *, machine: str | None = None, system: str | None = None,
                   soc: Any = None, adb: tuple[str, Any] | None = None) -> list[BackendCheck]:
    """The backends of this machine (host, runner) or, with ``adb`` (serial, its SoC), of that phone."""
    machine = machine or platform.machine()
    system = system or platform.system()
    if adb is not None:
        return [AdbCheck(adb[1], adb[0])]
    return [HostCheck(sdk, tuple(backends), machine, soc), RunnerCheck(sdk, machine, system, soc)]
