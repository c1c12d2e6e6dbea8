"""`python -m optimum_qnn doctor [PATH]`: what this installation can do, and why not when it cannot.

Prints the versions of the stack, the QNN libraries in use (path, source, QAIRT build, Hexagon skels), whether
ExecuTorch's runtime has the QNN backend registered, the SoCs that can be targeted and, with PATH, which exported
variants under it each backend of this host (`runtime.backends.availability`: ExecuTorch's Python runtime,
onnxruntime-qnn, ExecuTorch's C++ runner) can run, which runtime ``--device host`` uses and why, and what is missing
for the others. Exits non-zero, with the reason and the fix, when no backend can use QNN here.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from optimum_qnn import __version__
from optimum_qnn.config import Soc
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.program import is_emulator_host
from optimum_qnn.runtime.backends.availability import Answer, BackendCheck, backend_checks, onnxruntime_qnn_status
from optimum_qnn.runtime.backends.device import default_host_runtime
from optimum_qnn.sdk import QnnSdkError, ensure_qnn_sdk, supported_socs, unsigned_windows_skels
from optimum_qnn.runtime.backends.soc import HostSoc, detect_host_soc, from_name
from optimum_qnn.sdk.backend import QNN_BACKEND, executorch_backends, qnn_backend_missing_message

# Distribution name -> the version verified with this release (pyproject.toml's pins); None: any.
STACK = {
    "torch": "2.13.0",
    "executorch": "1.5.1",
    "torchao": None,
    "transformers": "5.23.0",
    "optimum": "2.3.0",
    "huggingface-hub": None,
    "onnxruntime-qnn": "2.5.0",
}


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, read from its metadata (nothing is imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _rows(rows: list[tuple[str, str]], out: TextIO) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}", file=out)


@dataclass(frozen=True)
class Verdict:
    """Which backends can run one exported variant here, and why the others cannot (`availability.Answer`s)."""

    variant: str
    description: str
    answers: tuple[Answer, ...]

    @property
    def runnable(self) -> bool:
        return any(a.runnable for a in self.answers)

    @property
    def reason(self) -> str:
        """The first backend's answer that says yes, else the first answer."""
        return next((a.reason for a in self.answers if a.runnable), self.answers[0].reason if self.answers else "")


def judge_variants(path: Path, checks: list[BackendCheck]) -> list[Verdict]:
    """Every exported variant (folder with a manifest.json) under `path`, judged by each backend of ``checks``."""
    from optimum_qnn.artifacts.manifest import ManifestError, read_manifest

    verdicts = []
    manifests = [path / "manifest.json"] if (path / "manifest.json").is_file() else sorted(path.rglob("manifest.json"))
    for manifest_path in manifests:
        folder = manifest_path.parent
        name = str(folder.relative_to(path)) if folder != path else folder.name
        try:
            manifest = read_manifest(folder)
        except ManifestError as e:
            verdicts.append(Verdict(name, "unreadable manifest", (Answer("manifest", False, str(e)),)))
            continue
        shared = manifest.contract.weight_sharing
        description = (
            f"{manifest.target.soc}, {manifest.quantization.scheme}, weights {'shared' if shared else 'not shared'}, "
            f"QAIRT {manifest.versions.qairt_build_id}"
        )
        verdicts.append(Verdict(name, description, tuple(check.judge(manifest, folder) for check in checks)))
    return verdicts


def _device_soc(adb_serial: str | None, system: str) -> HostSoc | None:
    """The SoC of the adb phone named (``ro.soc.model``), else of this machine."""
    if adb_serial is None:
        return detect_host_soc(system)
    from optimum_qnn.runtime.backends.adb import Adb

    adb = Adb(adb_serial or None)
    model = adb.getprop("ro.soc.model")
    if not model:
        return HostSoc("", f"adb {adb.serial}: getprop ro.soc.model is empty (Android 12+ sets it)", None)
    return from_name(model, f"adb {adb.serial}: getprop ro.soc.model")


def _runner_available() -> bool:
    from optimum_qnn.runtime.backends.bundle import find_runner
    from optimum_qnn.runtime.backends.device import DeviceError

    try:
        find_runner(None)
    except DeviceError:
        return False
    return True


def run_doctor(path: Path | None = None, out: TextIO | None = None, err: TextIO | None = None,
               adb_serial: str | None = None) -> int:
    """Print the diagnosis (to ``out`` and ``err``, by default ``sys.stdout`` and ``sys.stderr`` as they are when
    called); return the process exit code (0: QNN usable, 1: not).

    Raises:
        InvalidInputError: ``path`` is not a folder.
    """
    out, err = out or sys.stdout, err or sys.stderr
    if path is not None and not Path(path).is_dir():
        raise InvalidInputError(f"No such folder: {path}; pass an artifact folder (the --output of an export), or no path")
    machine, system = platform.machine(), platform.system()
    print(f"optimum-qnn {__version__}", file=out)
    versions = [("python", f"{platform.python_version()} ({machine}, {system})")]
    for dist, verified in STACK.items():
        found = installed_version(dist)
        # Compare without the local label: torch's CPU wheel is `2.13.0+cpu`.
        matches = found is None or verified is None or found.split("+")[0] == verified
        note = "" if matches else f"  (verified: {verified})"
        versions.append((dist, (found or "not installed") + note))
    _rows(versions, out)

    try:
        sdk = ensure_qnn_sdk()
    except QnnSdkError as error:
        print(f"\nQNN libraries: NOT USABLE\n  {error}", file=err)
        return 1

    print("\nQNN libraries", file=out)
    lib_dir = sdk.lib_dir
    where = f"{lib_dir} -> {lib_dir.resolve()}" if lib_dir.resolve() != lib_dir else str(lib_dir)
    rows = [("build id", sdk.build_id), ("source", sdk.source), ("QNN_SDK_ROOT", str(sdk.root)), ("libraries", where)]
    if sdk.skel_dirs:
        folders = sorted({str(d) for d in sdk.skel_dirs.values()})
        rows.append(("skels", f"HTP {', '.join(f'v{a}' for a in sdk.skel_dirs)} in {', '.join(folders)}"))
        unsigned = unsigned_windows_skels(sdk.skel_dirs) if sdk.htp_library.suffix == ".dll" else []
        if unsigned:  # Windows verifies a skel through its catalog before the NPU runs it
            rows.append(("unsigned", f"HTP {', '.join(f'v{a}' for a in unsigned)}: no libqnnhtpv<arch>.cat beside the skel"))
    _rows(rows, out)

    backends = executorch_backends()
    has_qnn = backends is not None and QNN_BACKEND in backends
    print("\nExecuTorch runtime", file=out)
    if backends is None:
        _rows([("installed", "no (the runtime install: in-process runs go through onnxruntime-qnn)")], out)
    else:
        _rows([
            ("backends", ", ".join(backends) or "none"),
            ("QNN backend", "registered" if has_qnn else "MISSING"),
            ("QNN runs on", "the x86 HTP emulator (builds without weight sharing)" if is_emulator_host(machine)
             else "this device's HTP"),
        ], out)
    ort = onnxruntime_qnn_status()
    print("\nonnxruntime-qnn", file=out)
    _rows([("QNN libraries", ort if isinstance(ort, str) else f"{ort[1]}, QAIRT {ort[0]}")], out)
    runtime, why = default_host_runtime()
    print("\nIn-process runs (--device host)", file=out)
    _rows([("runtime", f"{runtime}: {why}")], out)

    socs = supported_socs() if backends is not None else list(Soc)
    print("\nTargetable SoCs", file=out)
    _rows([(soc.value, soc.description) for soc in socs], out)

    device = _device_soc(adb_serial, system)
    print("\nThis host" if adb_serial is None else "\nThe phone", file=out)
    _rows([("SoC", device.describe() if device else
            "not a Snapdragon, or it does not say (Linux: /sys/devices/soc0/machine; Windows: the processor name)")], out)
    host = device.soc if device else None
    checks = backend_checks(sdk, backends, machine=machine, system=system, soc=host,
                            adb=None if adb_serial is None else (adb_serial or "(the only one)", host))
    if path is not None:
        verdicts = judge_variants(Path(path), checks)
        runnable = sum(v.runnable for v in verdicts)
        print(f"\nArtifacts under {path}: {runnable} of {len(verdicts)} can run here", file=out)
        width = max((len(a.backend) for v in verdicts for a in v.answers), default=0)
        for v in verdicts:
            print(f"  {v.variant} ({v.description})", file=out)
            for a in v.answers:
                print(f"    {a.backend.ljust(width)}  {'yes' if a.runnable else 'no'}: {a.reason}", file=out)

    status = 0
    if backends is not None and not has_qnn:
        print(f"\nQNN backend: MISSING\n  {qnn_backend_missing_message(backends, machine, system)}", file=err)
    if not has_qnn and isinstance(ort, str):  # neither in-process runtime: only ExecuTorch's runner can stand in
        if adb_serial is None and not _runner_available():
            status = 1
        else:
            print("  (--device runner / adb does not need it: ExecuTorch's qnn_llama_runner runs the variants)",
                  file=err)
    if not socs:
        print("  none: this executorch knows none of optimum-qnn's SoCs", file=err)
        status = 1
    return status
