"""The adb transport of the runner backend: pick a phone, run shell commands on it, move files, and ask it what
it is.

Only what `runner.RunnerBackend` needs, each call one `adb -s SERIAL ...` process: `devices`, `shell`, `push`,
`pull`. Everything that can go wrong on the way (no adb, no phone, several phones, an unauthorized or offline one)
raises `DeviceError` with the step that fixes it.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from optimum_qnn.config import Soc
from optimum_qnn.runtime.backends.device import DeviceError, DeviceSpec  # noqa: F401  (re-exported)

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


WORKSPACE = "/data/local/tmp/optimum_qnn"
FREE_SPACE_MARGIN = 64 << 20  # outputs, the prompt file, and some room for the phone itself


class AdbTransport:
    """The runner backend on a phone: a workspace under ``/data/local/tmp/optimum_qnn``, QAIRT's Android libraries
    for the variant's HTP arch from ``qnn_sdk_root`` (default ``$QNN_SDK_ROOT``), files pushed once (by sha256)."""

    shared_buffer_default = True
    weight_sharing_hint = "weights shared for a phone"

    def __init__(self, serial: str | None = None, *, qnn_sdk_root=None):
        self.serial_wanted = serial
        self.qnn_sdk_root = qnn_sdk_root
        self.workspace = WORKSPACE
        self.adb: Adb | None = None
        self.name = "adb" if serial is None else f"adb:{serial}"

    def qairt_libraries(self, htp_arch: int):
        from optimum_qnn.runtime.backends.bundle import android_libraries, library_build_id, sdk_root

        libs = android_libraries(sdk_root(self.qnn_sdk_root), htp_arch)
        return libs, library_build_id(libs[0]), f"{libs[0]}"

    def connect(self) -> None:
        self.adb = Adb(self.serial_wanted)
        self.name = f"adb:{self.adb.serial}"

    def _path(self, rel: str) -> str:
        return f"{self.workspace}/{rel}"

    def check_target(self, manifest) -> None:
        want = manifest.target.soc
        got = self.adb.getprop("ro.soc.model").upper()
        if not got:
            raise DeviceError(
                f"Phone {self.adb.serial} does not report its SoC (getprop ro.soc.model is empty; Android 12+ sets it), "
                f"so it cannot be checked against this variant's {want}"
            )
        if got != want:
            known = [s.value for s in Soc]
            fix = (f"load the {got} variant (soc='{got}') or export one with --soc {got}" if got in known
                   else f"this tool targets {', '.join(known)}")
            raise DeviceError(
                f"Phone {self.adb.serial} has a {got}, but this variant was compiled for {want} "
                f"(HTP v{manifest.target.htp_arch}): {fix}"
            )

    def install(self, files, variant_dir: str) -> list[str]:
        """Push the files that are missing or differ (by sha256), after checking the phone has room for them."""
        from optimum_qnn.artifacts.manifest import sha256_file

        remote_dir = self._path(variant_dir)
        self.adb.shell(f"mkdir -p {shlex.quote(remote_dir)}/tokenizer {shlex.quote(remote_dir)}/outputs")
        remote = {self._path(f.remote): f for f in files}
        on_phone = self.adb.sha256(list(remote))
        todo = [(path, f) for path, f in remote.items() if on_phone.get(path) != (f.sha256 or sha256_file(f.local))]
        need = sum(f.local.stat().st_size for _, f in todo)
        if todo:
            free = self.adb.free_bytes("/data/local/tmp")
            if free < need + FREE_SPACE_MARGIN:
                raise DeviceError(
                    f"Phone {self.adb.serial} has {free / 2**20:.0f} MiB free under /data/local/tmp but needs "
                    f"{(need + FREE_SPACE_MARGIN) / 2**20:.0f} MiB for {len(todo)} files: free some space "
                    f"(e.g. `adb shell rm -r {WORKSPACE}` removes earlier pushes), then retry"
                )
        logger.info("Pushing %d of %d files (%.1f MiB) to %s", len(todo), len(files), need / 2**20, self.name)
        for path, f in todo:
            self.adb.push(f.local, path)
        executables = [shlex.quote(path) for path, f in remote.items() if f.executable]
        self.adb.shell(f"chmod 755 {' '.join(executables)}")
        return [f.remote for _, f in todo]

    def put(self, local: Path, rel: str) -> None:
        self.adb.push(local, self._path(rel))

    def get(self, rel: str, local: Path) -> None:
        self.adb.pull(self._path(rel), local)

    def remove(self, rels: Sequence[str]) -> None:
        self.adb.shell("rm -f " + " ".join(shlex.quote(self._path(r)) for r in rels))

    def command(self, args: Sequence[str]) -> str:
        """The shell command that runs the runner on the phone: LD_LIBRARY_PATH holds the runner's backend library
        and QAIRT's, ADSP_LIBRARY_PATH is where the DSP finds the skel."""
        ws = shlex.quote(self.workspace)
        return (
            f"cd {ws} && export LD_LIBRARY_PATH={ws}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}} && "
            f"export ADSP_LIBRARY_PATH={ws} && {shlex.join(args)}"
        )

    def start(self, args: Sequence[str]) -> tuple[subprocess.Popen, str]:
        command = self.command(args)
        return self.adb.shell_process(command), command

    def log_tail(self) -> str:
        return self.adb.shell("logcat -d -t 40 -s ExecuTorch", timeout=60, check=False).stdout.strip()
