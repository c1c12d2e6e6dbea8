"""Signal-to-noise figures in one place: every wing and benchmark converts dB and noise ratios through these."""

from __future__ import annotations

import math

import torch


def db_of_noise(ratio: float) -> float:
    """A noise power over signal power as SQNR in dB (+inf for no noise)."""
    return math.inf if ratio <= 0 else -10 * math.log10(ratio)


def noise_of_db(db: float) -> float:
    """SQNR in dB as noise power over signal power (0 for +inf)."""
    return 0.0 if math.isinf(db) else 10 ** (-db / 10)


def sqnr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``got`` against ``ref`` in dB, over all elements."""
    noise = (got.double() - ref.double()).pow(2).mean().item()
    return math.inf if noise == 0 else db_of_noise(noise / ref.double().pow(2).mean().item())
