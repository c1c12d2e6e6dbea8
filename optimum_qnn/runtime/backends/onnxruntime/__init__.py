"""The onnxruntime backend: runs a variant's `.pte` through onnxruntime-qnn with numpy, without torch or ExecuTorch.

Importing this package is cheap: onnxruntime loads with the first `OrtProgram`.
"""

from __future__ import annotations

from optimum_qnn.sdk.onnxruntime_ep import OrtBackendError
from optimum_qnn.runtime.backends.onnxruntime.program import OrtProgram

__all__ = ["OrtBackendError", "OrtProgram"]
