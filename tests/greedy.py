"""Comparing an export's greedy ids with Hugging Face's where the reference itself nearly ties.

Greedy decoding follows the argmax; where Hugging Face's fp32 logits put two tokens within a few thousandths of
each other, fp16's rounding (and the HTP's) decides between them, and from there the two sequences are different
texts, neither wrong. The demo model trained with portable kernels has such steps: "The for statement" reaches one
where tokens 470 and 295 are 0.003 apart (fp32 logits), and another at 0.0016. So the ids must be equal up to the
first difference, and that difference must fall on a near tie of the reference: the export's token within `TIE` of
the reference's best logit there. The logits at every step are checked apart from this (SQNR, teacher-forced).
"""

from __future__ import annotations

import torch

# Above the near ties met (0.0016, 0.003 apart) and below the decided steps' margins on that prompt (0.037 to 4.6,
# measured in fp32); how far fp16's logits may stray is bounded apart (FP16_MIN_SQNR_DB, tests/test_export.py).
TIE = 0.02


def assert_greedy_agrees(got: list[int], ref: list[int], ref_logits: torch.Tensor, prompt_len: int) -> int:
    """``got`` equals ``ref`` (prompt and new ids), or first differs where ``ref_logits`` (Hugging Face's, one row per
    new token) put ``got``'s token within `TIE` of the best; returns how many new tokens agree."""
    assert got[:prompt_len] == ref[:prompt_len]
    n = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    if n == len(ref) and len(got) == len(ref):
        return n - prompt_len
    assert n < len(got) and n < len(ref), (got, ref)
    row = ref_logits[n - prompt_len]
    margin = float(row.max() - row[got[n]])
    assert margin < TIE, f"new token {n - prompt_len}: {got[n]} where Hugging Face has {ref[n]}, {margin:.4f} below its best"
    print(f"near tie at new token {n - prompt_len}: {got[n]} against Hugging Face's {ref[n]} ({margin:.4f} apart)")
    return n - prompt_len
