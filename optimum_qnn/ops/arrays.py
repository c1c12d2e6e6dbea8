"""numpy at the runtime's seam, torch where the caller brought it.

The runtime computes on numpy arrays so that running an artifact needs no torch; the exporter and the tests drive
the same code with torch tensors. These two functions are the whole bridge: nothing here imports torch unless the
caller's value already is a torch tensor (so torch is already imported).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (checked by type, without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "numpy")


def as_numpy(x: Any) -> np.ndarray:
    """``x`` (a numpy array, a torch CPU tensor, a list, a scalar) as a numpy array, without a copy where it can."""
    if is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def like(x: Any, result: np.ndarray) -> Any:
    """``result`` as the kind of array ``x`` is: a torch tensor (sharing memory) when ``x`` is one, else numpy."""
    if is_torch(x):
        import torch

        return torch.from_numpy(np.ascontiguousarray(result))
    return result
