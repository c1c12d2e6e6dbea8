"""Additive masks of the static graph, against a brute-force definition of (sliding) causal attention."""

from __future__ import annotations

import pytest
import torch

from optimum_qnn.ops.mask import MASK_MIN, attention_mask


def brute(ar, ctx, n_past, window):
    cache = ctx - ar
    out = torch.full((ar, ctx), MASK_MIN)
    for i in range(ar):
        q = n_past + i
        for col in range(ctx):
            pos = col if col < cache else n_past + (col - cache)
            valid = col < n_past if col < cache else (col - cache) <= i
            if valid and (window is None or q - pos < window):
                out[i, col] = 0.0
    return out


@pytest.mark.parametrize("ar,ctx,n_past,window", [(1, 8, 0, None), (1, 8, 7, 3), (3, 10, 4, None), (3, 10, 7, 2), (4, 12, 5, 4)])
def test_mask_matches_definition(ar, ctx, n_past, window):
    assert torch.equal(attention_mask(ar, ctx, n_past, window=window)[0, 0], brute(ar, ctx, n_past, window))


def test_n_past_outside_cache_raises():
    with pytest.raises(ValueError, match="outside the cache"):
        attention_mask(4, 8, 5)
