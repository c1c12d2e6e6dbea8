"""A stand-in for `adb` that only does transport, for tests: a local folder stands for the phone's filesystem.

Installed by tests/test_device_adb.py as an executable named `adb` first on PATH. Its state comes from the JSON
file named by $FAKE_ADB_CONFIG:

    {"root": "/tmp/.../phone",            # the phone's "/"; absolute /data/... paths are mapped below it
     "devices": [["SERIAL", "device"]],   # what `adb devices` lists
     "soc": "SM8650",                     # what `getprop ro.soc.model` answers
     "df_kb": 1000000,                    # the Available column of `df -k`
     "env": {"LD_LIBRARY_PATH": "..."},   # the phone shell's own environment (system library folders)
     "log": "/tmp/.../adb.log"}           # every invocation is appended here, one JSON list per line

`shell` runs its command with /bin/sh in the phone folder (after mapping /data/ paths), so a runner built for this
machine runs there as it would on a phone; the exit status is the command's, as with adb's shell protocol v2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    config = json.loads(Path(os.environ["FAKE_ADB_CONFIG"]).read_text())
    with open(config["log"], "a") as log:
        log.write(json.dumps(argv) + "\n")
    root = Path(config["root"])
    devices = [tuple(d) for d in config["devices"]]

    def phone(path: str) -> Path:
        return root / path.lstrip("/")

    if argv == ["devices"]:
        print("List of devices attached")
        for serial, state in devices:
            print(f"{serial}\t{state}")
        print()
        return 0
    if argv[:1] == ["-s"]:
        serial, argv = argv[1], argv[2:]
        if serial not in dict(devices):
            print(f"adb: device '{serial}' not found", file=sys.stderr)
            return 1
    elif len(devices) != 1:
        print("adb: more than one device/emulator" if devices else "adb: no devices/emulators found", file=sys.stderr)
        return 1
    command, args = argv[0], argv[1:]
    if command == "push":
        local, remote = Path(args[0]), phone(args[1])
        if remote.is_dir():
            remote = remote / local.name
        remote.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, remote)  # follows symlinks, as adb push does
        print(f"{args[0]}: 1 file pushed.")
        return 0
    if command == "pull":
        remote, local = phone(args[0]), Path(args[1])
        if not remote.is_file():
            print(f"adb: error: failed to stat remote object '{args[0]}': No such file or directory", file=sys.stderr)
            return 1
        shutil.copyfile(remote, local)
        print(f"{args[0]}: 1 file pulled.")
        return 0
    if command == "shell":
        line = " ".join(args)
        if line == "getprop ro.soc.model":
            print(config["soc"])
            return 0
        if line.startswith("df "):
            print("Filesystem     1K-blocks    Used Available Use% Mounted on")
            print(f"/dev/block/dm-7 999999999 1 {config['df_kb']} 1% /data")
            return 0
        mapped = line
        for before in (" ", "=", "'"):
            mapped = mapped.replace(f"{before}/data/", f"{before}{root}/data/")
        env = {"PATH": os.environ["PATH"], **config.get("env", {})}
        proc = subprocess.Popen(["/bin/sh", "-c", mapped], cwd=root, env=env, stdout=subprocess.PIPE)
        for out in proc.stdout:  # line by line, with the phone's paths shown as the phone would show them
            sys.stdout.buffer.write(out.replace(f"{root}/data/".encode(), b"/data/"))
            sys.stdout.buffer.flush()
        return proc.wait()
    print(f"fake adb: unsupported command {argv}", file=sys.stderr)
    return 1


def put_on_path(folder: Path, monkeypatch) -> None:
    """Install this stand-in as `adb`, first on PATH, for one test (`monkeypatch`: pytest's fixture)."""
    folder.mkdir(parents=True, exist_ok=True)
    adb = folder / "adb"
    adb.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n')
    adb.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
