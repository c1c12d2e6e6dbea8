"""The QNN libraries: where they are (`finding`), which QAIRT they are (`versions`), setting them up (`loading`).

Example:
    >>> from optimum_qnn.sdk import ensure_qnn_sdk
    >>> sdk = ensure_qnn_sdk()  # before anything lowers to or runs on QNN
    >>> sdk.build_id
    'v2.49.40.260810104044'
"""

from optimum_qnn.sdk.finding import (
    ORT_QNN_DIST,
    REQUIRED_ORT_QNN_VERSION,
    SDK_ROOT_ENV,
    SOURCE_ORT_QNN,
    Host,
    QnnSdkError,
    RegistryLibraries,
    adsp_library_path,
    check_onnxruntime_qnn_version,
    find_host_lib_dir,
    find_skel_dirs,
    host_for,
    host_lib_dir_patterns,
    registry_libraries,
    unsigned_windows_skels,
)
from optimum_qnn.sdk.loading import QnnSdk, ensure_qnn_sdk, read_build_id, supported_socs
from optimum_qnn.sdk.versions import check_runtime_can_load, parse_build_id, qairt_major_minor

__all__ = [
    "ORT_QNN_DIST",
    "REQUIRED_ORT_QNN_VERSION",
    "SDK_ROOT_ENV",
    "SOURCE_ORT_QNN",
    "Host",
    "QnnSdk",
    "QnnSdkError",
    "RegistryLibraries",
    "adsp_library_path",
    "check_onnxruntime_qnn_version",
    "check_runtime_can_load",
    "ensure_qnn_sdk",
    "find_host_lib_dir",
    "find_skel_dirs",
    "host_for",
    "host_lib_dir_patterns",
    "parse_build_id",
    "qairt_major_minor",
    "read_build_id",
    "registry_libraries",
    "supported_socs",
    "unsigned_windows_skels",
]
