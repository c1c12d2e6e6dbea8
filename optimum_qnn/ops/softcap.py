"""Logit soft-capping, ``cap * tanh(x / cap)``, in the form the QNN HTP computes correctly for each precision."""

from __future__ import annotations

import torch


def softcap(x: torch.Tensor, cap: float, *, quantized: bool = False) -> torch.Tensor:
    """``cap * tanh(x / cap)``.

    The form depends on the precision of the graph. Lowered by executorch 1.5.1 with QAIRT 2.49 and run on the x86
    HTP emulator, each obvious form fails somewhere (SQNR in dB of ``[1, ar, 256]`` logits against the eager /
    fake-quant graph)::

        form                                fp16 ar=1   fp16 ar=16   16a8w ar=1   16a8w ar=16
        tanh(x / cap) * cap  (fp16)            65.3        62           78.3        -2.4 (rows 2.. wrong)
        tanh(x * (1 / cap)) * cap  (quant)     40.5        65.9         78.3        78.0
        sigmoid(2x / cap) * 2cap - cap         57.1        56.4         76.2        77.2 (fp16: greedy flips
                                                                                      on saturated top logits)

    Args:
        x: logits.
        cap: the soft cap (``final_logit_softcapping``).
        quantized: the graph will be PT2E-quantized.

    ``tests/test_htp_pitfalls.py::test_softcap_on_the_htp`` checks all four cases.
    """
    if quantized:
        return torch.tanh(x * (1.0 / cap)) * cap
    return torch.tanh(x / cap) * cap
