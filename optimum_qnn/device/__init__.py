"""Running exported variants on an Android phone: the adb transport (`adb.py`), what gets pushed (`bundle.py`) and
the model that drives ExecuTorch's ``qnn_llama_runner`` there (`phone.py`).

Importing this package is cheap; `PhoneModelForCausalLM` (which imports torch) loads on first use.
"""

from __future__ import annotations

from optimum_qnn.device.adb import DeviceError, DeviceSpec

__all__ = ["DeviceError", "DeviceSpec", "PhoneModelForCausalLM"]


def __getattr__(name: str):
    if name == "PhoneModelForCausalLM":
        from optimum_qnn.device.phone import PhoneModelForCausalLM

        return PhoneModelForCausalLM
    raise AttributeError(f"module 'optimum_qnn.device' has no attribute {name!r}")
