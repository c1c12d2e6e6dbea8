"""Where a model runs, as the user names it, and the error for a device that cannot be used."""

from __future__ import annotations

from dataclasses import dataclass

from optimum_qnn.errors import InvalidInputError, OptimumQnnError

DEVICES = "host, host:executorch, host:onnxruntime, runner, adb, adb:SERIAL"
# The runtimes a variant's graphs can run in within this process (`device="host:<runtime>"`).
HOST_RUNTIMES = ("executorch", "onnxruntime")


class DeviceError(OptimumQnnError, RuntimeError):
    """A device (a phone, a board, this machine's runner) cannot be reached or used; the message says what to do."""


class UnknownDeviceError(InvalidInputError, ValueError):
    """A device name that is none of `DEVICES`."""


@dataclass(frozen=True)
class DeviceSpec:
    """``host`` (in this process: ``runtime`` ExecuTorch's Python runtime or onnxruntime-qnn, None for this host's
    default), ``runner`` (ExecuTorch's C++ runner here) or ``adb`` (that runner on a phone; ``serial`` picks one)."""

    kind: str
    serial: str | None = None
    runtime: str | None = None

    @classmethod
    def parse(cls, text: object) -> "DeviceSpec":
        """``"host"``, ``"host:executorch"``, ``"host:onnxruntime"``, ``"runner"``, ``"adb"`` or ``"adb:SERIAL"``;
        anything else raises `UnknownDeviceError`."""
        if isinstance(text, DeviceSpec):
            return text
        value = str(text).strip()
        if value in ("host", "runner", "adb"):
            return cls(value)
        if value.startswith("host:") and value[5:].strip().lower() in HOST_RUNTIMES:
            return cls("host", runtime=value[5:].strip().lower())
        if value.startswith("adb:") and value[4:].strip():
            return cls("adb", value[4:].strip())
        raise UnknownDeviceError(f"Unknown device {text!r}; expected one of: {DEVICES}")

    def __str__(self) -> str:
        if self.runtime is not None:
            return f"{self.kind}:{self.runtime}"
        return self.kind if self.serial is None else f"{self.kind}:{self.serial}"


def default_host_runtime() -> tuple[str, str]:
    """The runtime ``device="host"`` uses on this machine, and why: ExecuTorch's Python runtime where it has its QNN
    backend (the registry's x86_64 Linux wheel), onnxruntime-qnn everywhere else (no ExecuTorch installed: the
    runtime install; or an ExecuTorch without QNN: the registry's aarch64 wheel)."""
    from optimum_qnn.sdk.backend import QNN_BACKEND, executorch_backends

    try:
        backends = executorch_backends()
    except (ImportError, OSError) as e:
        return "onnxruntime", f"ExecuTorch's runtime does not load here ({e})"
    if backends is None:
        return "onnxruntime", "ExecuTorch is not installed (the runtime install)"
    if QNN_BACKEND not in backends:
        return "onnxruntime", f"ExecuTorch here has no QNN backend (registered: {', '.join(backends) or 'none'})"
    return "executorch", "ExecuTorch here has its QNN backend"
