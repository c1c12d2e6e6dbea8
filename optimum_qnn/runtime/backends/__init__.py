"""The runtime's backends: `host` (ExecuTorch's Python runtime in this process), `onnxruntime` (the same .pte through
onnxruntime-qnn and numpy, no torch) and `runner` (ExecuTorch's C++ ``qnn_llama_runner``, through a transport: `adb`
to a phone, or `local` on this machine).

Importing this package is cheap: the backends (which import torch) load on first use.
"""

from __future__ import annotations

from optimum_qnn.runtime.backends.device import DeviceError, DeviceSpec

__all__ = ["DeviceError", "DeviceSpec"]
