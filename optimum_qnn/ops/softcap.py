"""Logit soft-capping, ``tanh(x / cap) * cap``, in the form the QNN HTP computes correctly (pure tensor math)."""

from __future__ import annotations

import torch


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``, written as a multiply by ``1 / cap``.

    Quantized (16-bit activation) graphs lowered by executorch 1.5.1 with QAIRT 2.49 compute ``tanh(conv_out)`` and
    ``tanh(conv_out / cap)`` wrongly on all rows but the first two of a ``[1, ar, V]`` prefill tensor (logits SQNR
    -8 dB against the fake-quant graph), while ``tanh(conv_out * (1 / cap))`` is exact (78 dB). Decode (ar = 1) and
    fp16 graphs are unaffected. ``tests/test_lowering.py::test_quantized_softcap_is_exact_on_every_row`` checks it.
    """
    return torch.tanh(x * (1.0 / cap)) * cap
