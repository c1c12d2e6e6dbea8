"""Where a model runs, as the user names it, and the error for a device that cannot be used."""

from __future__ import annotations

from dataclasses import dataclass

from optimum_qnn.errors import InvalidInputError, OptimumQnnError

DEVICES = "host, runner, adb, adb:SERIAL"


class DeviceError(OptimumQnnError, RuntimeError):
    """A device (a phone, a board, this machine's runner) cannot be reached or used; the message says what to do."""


class UnknownDeviceError(InvalidInputError, ValueError):
    """A device name that is none of `DEVICES`."""


@dataclass(frozen=True)
class DeviceSpec:
    """``host`` (ExecuTorch's Python runtime here), ``runner`` (ExecuTorch's C++ runner here) or ``adb`` (that runner
    on a phone; ``serial`` picks one)."""

    kind: str
    serial: str | None = None

    @classmethod
    def parse(cls, text: object) -> "DeviceSpec":
        """``"host"``, ``"runner"``, ``"adb"`` or ``"adb:SERIAL"``; anything else raises `UnknownDeviceError`."""
        if isinstance(text, DeviceSpec):
            return text
        value = str(text).strip()
        if value in ("host", "runner", "adb"):
            return cls(value)
        if value.startswith("adb:") and value[4:].strip():
            return cls("adb", value[4:].strip())
        raise UnknownDeviceError(f"Unknown device {text!r}; expected one of: {DEVICES}")

    def __str__(self) -> str:
        return self.kind if self.serial is None else f"{self.kind}:{self.serial}"
