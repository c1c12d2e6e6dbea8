"""The adb transport: pick a phone, run shell commands on it, move files, and ask it what it is.

Only what `PhoneModelForCausalLM` needs, each call one `adb -s SERIAL ...` process: `devices`, `shell`, `push`,
`pull`. Everything that can go wrong on the way (no adb, no phone, several phones, an unauthorized or offline one)
raises `DeviceError` with the step that fixes it.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from optimum_qnn.errors import InvalidInputError, OptimumQnnError

logger = logging.getLogger(__name__)

_STATE_FIXES = {
    "unauthorized": "unlock the phone and accept its 'Allow USB debugging?' prompt (tick 'Always allow'), then retry",
    "offline": "reconnect the USB cable, or restart adb with `adb kill-server`, then retry",
    "no permissions": "this user may not open the USB device: add a udev rule for the phone (or run `adb kill-server` "
    "then `sudo adb start-server`), then retry",
    "bootloader": "boot the phone into Android, then retry",
    "recovery": "boot the phone into Android, then retry",
    "sideload": "boot the phone into Android, then retry",
}


class DeviceError(OptimumQnnError, RuntimeError):
    """A phone cannot be reached or used; the message says what to do."""


@dataclass(frozen=True)
class DeviceSpec:
    """Where a model runs: ``host`` (this machine, `QNNModelForCausalLM`) or ``adb`` (a phone; ``serial`` picks one)."""

    kind: str
    serial: str | None = None

    @classmethod
    def parse(cls, text: str) -> "DeviceSpec":
        """``"host"``, ``"adb"`` or ``"adb:SERIAL"``; anything else raises InvalidInputError (a ValueError) naming
        those."""
        value = str(text).strip()
        if value == "host":
            return cls("host")
        if value == "adb":
            return cls("adb")
        if value.startswith("adb:") and value[4:].strip():
            return cls("adb", value[4:].strip())
        raise InvalidInputError(
            f"Unknown device {text!r}; expected one of: host, adb, adb:SERIAL (host: this machine's QNN runtime; adb: "
            "the one phone connected; adb:SERIAL: the phone of that serial in `adb devices`)"
        )

    def __str__(self) -> str:
        return self.kind if self.serial is None else f"{self.kind}:{self.serial}"


def parse_devices(text: str) -> list[tuple[str, str]]:
    """``(serial, state)`` pairs from the output of ``adb devices`` (states: device, unauthorized, offline...)."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("List of devices", "*")):  # "* daemon started successfully"
            continue
        serial, _, state = line.partition("\t") if "\t" in line else line.partition(" ")
        found.append((serial.strip(), state.strip().split(" (")[0]))
    return found


def find_adb() -> str:
    """The ``adb`` executable on PATH."""
    found = shutil.which("adb")
    if found is None:
        raise DeviceError(
            "adb was not found on PATH. Install Android's platform-tools (`sudo apt-get install adb`, or "
            "https://developer.android.com/tools/releases/platform-tools) and put `adb` on PATH"
        )
    return found


class Adb:
    """One phone, reached through adb.

    Args:
        serial: the phone's serial (``adb devices``); None picks the only phone connected.
        executable: the adb program; default `find_adb()`.

    Raises:
        DeviceError: no adb, no phone, several phones and no serial, or the phone is not usable (unauthorized...).
    """

    def __init__(self, serial: str | None = None, executable: str | None = None):
        self.executable = executable or find_adb()
        self.serial = self._pick(serial)

    def _pick(self, serial: str | None) -> str:
        proc = self._run([self.executable, "devices"], timeout=60)
        devices = parse_devices(proc.stdout)
        listing = ", ".join(f"{s} ({state})" for s, state in devices)
        if serial is not None:
            state = dict(devices).get(serial)
            if state is None:
                raise DeviceError(
                    f"No phone with serial {serial!r} is connected (adb devices lists: {listing or 'none'}); "
                    "check the serial with `adb devices`"
                )
        else:
            if not devices:
                raise DeviceError(
                    "No phone is connected (adb devices lists none): plug it in by USB, turn on USB debugging "
                    "(Settings > Developer options) and accept the prompt on the phone"
                )
            if len(devices) > 1:
                raise DeviceError(
                    f"Several phones are connected ({listing}): pick one with device='adb:SERIAL' (--device adb:SERIAL)"
                )
            serial, state = devices[0]
        if state != "device":
            fix = _STATE_FIXES.get(state, "check it with `adb devices`, then retry")
            raise DeviceError(f"Phone {serial} is {state}: {fix}")
        return serial

    def _run(self, cmd: list[str], *, timeout: float | None = None, check: bool = True) -> subprocess.CompletedProcess:
        logger.debug("%s", shlex.join(cmd))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DeviceError(f"`{shlex.join(cmd)}` did not finish in {timeout:.0f} s; is the phone still connected?") from None
        if check and proc.returncode != 0:
            raise DeviceError(
                f"`{shlex.join(cmd)}` failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        return proc

    def command(self, *args: str) -> list[str]:
        """The argv of ``adb -s SERIAL <args>``."""
        return [self.executable, "-s", self.serial, *args]

    def shell(self, command: str, *, timeout: float | None = 600, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``command`` with the phone's shell; its exit status is the remote one (adb's shell protocol v2)."""
        return self._run(self.command("shell", command), timeout=timeout, check=check)

    def shell_process(self, command: str) -> subprocess.Popen:
        """Start ``command`` on the phone and return the local process, its stdout and stderr as pipes (bytes)."""
        cmd = self.command("shell", command)
        logger.debug("%s", shlex.join(cmd))
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def push(self, local: Path, remote: str) -> None:
        self._run(self.command("push", str(local), remote), timeout=None)

    def pull(self, remote: str, local: Path) -> None:
        self._run(self.command("pull", remote, str(local)), timeout=600)

    def getprop(self, name: str) -> str:
        return self.shell(f"getprop {shlex.quote(name)}", timeout=60).stdout.strip()

    def sha256(self, paths: list[str]) -> dict[str, str]:
        """sha256 of the phone's files among ``paths`` (missing ones are left out)."""
        if not paths:
            return {}
        proc = self.shell("sha256sum " + " ".join(shlex.quote(p) for p in paths) + " 2>/dev/null", timeout=None, check=False)
        found = {}
        for line in proc.stdout.splitlines():
            digest, _, path = line.strip().partition(" ")
            if len(digest) == 64:
                found[path.strip().lstrip("*")] = digest.lower()
        return found

    def free_bytes(self, path: str) -> int:
        """Bytes available to the filesystem holding ``path`` (``df -k``; the folder need not exist yet)."""
        proc = self.shell(f"df -k {shlex.quote(path)}", timeout=60)
        return parse_df_available_kb(proc.stdout) * 1024


def parse_df_available_kb(text: str) -> int:
    """The 'Available' column (KiB) of ``df -k`` output for one path (POSIX and toybox layouts)."""
    lines = [line.split() for line in text.strip().splitlines() if line.strip()]
    if len(lines) < 2:
        raise DeviceError(f"Cannot read the phone's free space from `df -k`: {text.strip()!r}")
    # A long filesystem name wraps the data onto two lines on some phones: read the data as one row.
    header, fields = lines[0], [f for line in lines[1:] for f in line]
    column = next((i for i, name in enumerate(header) if name.lower() in ("available", "avail")), 3)
    try:
        return int(fields[column])
    except (ValueError, IndexError):
        raise DeviceError(f"Cannot read the phone's free space from `df -k`: {text.strip()!r}") from None
