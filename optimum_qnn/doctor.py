"""`python -m optimum_qnn doctor`: what this installation can do, and why not when it cannot.

Prints the versions of the stack, the QNN libraries in use (path, source, build id) and the SoCs that can be
targeted. Exits non-zero, with the reason, when the QNN libraries cannot be set up.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import TextIO

from optimum_qnn import __version__
from optimum_qnn.sdk import QnnSdkError, ensure_qnn_sdk, supported_socs

# Distribution name -> the version verified with this release (docs/environment.md); None: any.
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


def run_doctor(out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Print the diagnosis; return the process exit code (0: QNN usable, 1: not)."""
    print(f"optimum-qnn {__version__}", file=out)
    versions = [("python", f"{platform.python_version()} ({platform.machine()})")]
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
    _rows(
        [
            ("build id", sdk.build_id),
            ("source", sdk.source),
            ("QNN_SDK_ROOT", str(sdk.root)),
            ("libraries", where),
        ],
        out,
    )

    socs = supported_socs()
    print("\nTargetable SoCs", file=out)
    _rows([(soc.value, f"HTP v{soc.htp_arch}") for soc in socs], out)
    if not socs:
        print("  none: this executorch knows none of optimum-qnn's SoCs", file=err)
        return 1
    return 0
