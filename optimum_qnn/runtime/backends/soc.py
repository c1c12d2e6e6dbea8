"""Which Snapdragon this machine is, where Linux says it (``/sys/devices/soc0``)."""

from __future__ import annotations

from pathlib import Path

from optimum_qnn.config import Soc

SOC0 = Path("/sys/devices/soc0")


def host_soc(soc0: Path = SOC0) -> str | None:
    """The SoC name this tool uses (e.g. ``SM8650``) when ``soc0/machine`` names one it knows, else None."""
    try:
        machine = (soc0 / "machine").read_text().strip().upper()
    except OSError:
        return None
    known = {s.value for s in Soc}
    return machine if machine in known else None
