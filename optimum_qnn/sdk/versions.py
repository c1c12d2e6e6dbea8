"""QAIRT build ids, and whether a runtime can load context binaries compiled by another QAIRT release.

A QNN context binary compiled with QAIRT major.minor X loads only on a runtime of QAIRT X or newer; patch and
build do not matter. Pure functions: nothing here loads a library.
"""

from __future__ import annotations

import re

from optimum_qnn.sdk.finding import ORT_QNN_DIST, ORT_QNN_QAIRT, SDK_ROOT_ENV, QnnSdkError

# QAIRT build ids look like `v2.49.40.260810104044` (major.minor.patch.timestamp).
_BUILD_ID_RE = re.compile(rb"v2\.\d{1,3}\.\d{1,3}\.\d{6,}")
_MAJOR_MINOR_RE = re.compile(r"v?(\d+)\.(\d+)(?:\.|$)")


def parse_build_id(data: bytes) -> str | None:
    """The first QAIRT build id (`v2.NN.NN.NNNNNN...`) in a library's bytes, or None."""
    match = _BUILD_ID_RE.search(data)
    return match.group().decode() if match else None


def qairt_major_minor(build_id: str) -> tuple[int, int]:
    """`v2.49.40.260810104044` (or `2.49.40`) -> (2, 49).

    Raises:
        QnnSdkError: for a string that does not start with a QAIRT version.
    """
    match = _MAJOR_MINOR_RE.match(build_id.strip())
    if match is None:
        raise QnnSdkError(f"{build_id!r} is not a QAIRT build id (expected e.g. v2.49.40.260810104044)")
    return int(match.group(1)), int(match.group(2))


def registry_fix(needed: tuple[int, int]) -> str:
    """How to get QNN libraries of QAIRT `needed` or newer: the registry package when one carries them."""
    wanted = ".".join(map(str, needed))
    for version, qairt in sorted(ORT_QNN_QAIRT.items(), key=lambda item: qairt_major_minor(item[1]), reverse=True):
        if qairt_major_minor(qairt) >= needed:
            return (
                f"pip install {ORT_QNN_DIST}=={version} (QAIRT {qairt}; wheels for x86_64 Linux, aarch64 Linux and "
                f"Windows on Snapdragon), or set {SDK_ROOT_ENV} to a QAIRT {wanted}+ SDK"
            )
    newest = max(ORT_QNN_QAIRT.items(), key=lambda item: qairt_major_minor(item[1]))
    return (
        f"set {SDK_ROOT_ENV} to a QAIRT {wanted}+ SDK (no registry package carries it: {ORT_QNN_DIST}=={newest[0]} "
        f"has QAIRT {newest[1]})"
    )


def check_runtime_can_load(artifact_build_id: str, runtime_build_id: str, runtime_source: str | None = None) -> None:
    """Refuse a runtime older than the QAIRT that compiled a model's context binaries.

    Args:
        artifact_build_id: the QAIRT build id the model was exported with (`manifest.versions.qairt_build_id`).
        runtime_build_id: the build id of the QNN libraries of this process (`QnnSdk.build_id`).
        runtime_source: where those libraries come from (`QnnSdk.source`), named in the message.

    Raises:
        QnnSdkError: naming both versions and the two fixes (newer runtime libraries, or an older export).
    """
    artifact = qairt_major_minor(artifact_build_id)
    runtime = qairt_major_minor(runtime_build_id)
    if runtime >= artifact:
        return
    needed, have = ".".join(map(str, artifact)), ".".join(map(str, runtime))
    origin = f", from {runtime_source}" if runtime_source else ""
    raise QnnSdkError(
        f"This model was compiled with QAIRT {needed} ({artifact_build_id}) but the QNN runtime here is QAIRT {have} "
        f"({runtime_build_id}{origin}); QNN context binaries load only on the QAIRT version that compiled them or a "
        f"newer one. Fix: {registry_fix(artifact)}; or re-export the model with QAIRT {have} ({SDK_ROOT_ENV} "
        "pointing at that SDK during the export)."
    )
