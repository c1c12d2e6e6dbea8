"""Which Snapdragon a host is, where it can tell: Linux's ``/sys/devices/soc0``, Windows' processor name, an Android
phone's ``ro.soc.model`` (read through adb by the caller)."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from optimum_qnn.config import Soc

SOC0 = Path("/sys/devices/soc0")
# Windows on Snapdragon names its processor in the registry, e.g. "Snapdragon(R) X Elite - X1E78100 - Qualcomm(R)
# Oryon(TM) CPU": the marketing name is all it gives, so only SoCs with a marketing name unique to them match.
_WINDOWS_CPU_KEY = r"HARDWARE\DESCRIPTION\System\CentralProcessor\0"
_WINDOWS_NAMES = {"Snapdragon(R) X Elite": Soc.SC8380XP, "Snapdragon X Elite": Soc.SC8380XP}


@dataclass(frozen=True)
class HostSoc:
    """What a host says about its SoC: the raw text, where it was read, and the SoC it names (None: not one of ours)."""

    said: str
    source: str
    soc: Soc | None

    def describe(self) -> str:
        if self.soc is not None:
            return f"{self.soc.label} (from {self.source})"
        return f"{self.said!r} (from {self.source}): not a SoC this exporter targets"


def from_name(name: str, source: str) -> HostSoc:
    """A SoC part number as a host reports it (``SM8650``, ``sm8650``) -> HostSoc."""
    name = name.strip()
    try:
        soc = Soc.parse(name)
    except ValueError:
        soc = None
    return HostSoc(name, source, soc)


def linux_soc(soc0: Path = SOC0) -> HostSoc | None:
    """``soc0/machine`` (the part number Qualcomm's socinfo driver reports), with ``soc0/soc_id`` shown when the
    machine is not one of ours; None when there is no soc0 (not a Qualcomm Linux host)."""
    try:
        machine = (soc0 / "machine").read_text().strip()
    except OSError:
        return None
    reading = from_name(machine, f"{soc0}/machine")
    if reading.soc is None:
        try:
            soc_id = (soc0 / "soc_id").read_text().strip()
        except OSError:
            soc_id = "?"
        reading = HostSoc(f"{machine} (soc_id {soc_id})", reading.source, None)
    return reading


def windows_soc(processor_name: str | None = None) -> HostSoc | None:
    """The SoC of a Windows on Snapdragon host, from its processor name (read from the registry when not given)."""
    if processor_name is None:
        try:
            import winreg

            with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, _WINDOWS_CPU_KEY) as key:
                processor_name = str(winreg.QueryValueEx(key, "ProcessorNameString")[0])
        except (ImportError, OSError):
            return None
    soc = next((s for name, s in _WINDOWS_NAMES.items() if processor_name.startswith(name)), None)
    return HostSoc(processor_name.strip(), "the Windows processor name", soc)


def detect_host_soc(system: str | None = None, soc0: Path = SOC0) -> HostSoc | None:
    """This machine's SoC as far as its OS tells, or None (an x86 PC, or a host that says nothing)."""
    system = system or platform.system()
    if system == "Windows":
        return windows_soc()
    if system == "Linux":
        return linux_soc(soc0)
    return None


def host_soc(soc0: Path = SOC0) -> str | None:
    """The SoC name this tool uses (e.g. ``SM8650``) when ``soc0/machine`` names one it knows, else None."""
    reading = linux_soc(soc0)
    return reading.soc.value if reading and reading.soc else None
