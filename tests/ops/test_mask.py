"""Additive masks of the static graph, against a brute-force definition of (sliding) causal attention."""

from __future__ import annotations

import numpy as np
import pytest

from optimum_qnn.ops.mask import MASK_MIN, attention_mask, draft_mask, ring_mask


def brute(ar, ctx, n_past, window, n_valid=None):
    """Row i is the token at position n_past + i; a column is open when it holds a real token of an earlier or
    the same position within the window. With ``n_valid``, the call's tokens from n_valid on are padding: real
    tokens never attend to them, and padding rows attend only the real tokens before them (never a padding
    column, not even their own: no row of the call ever reads a padding token's K/V)."""
    cache = ctx - ar
    out = np.full((ar, ctx), MASK_MIN, dtype=np.float32)
    for i in range(ar):
        q = n_past + i
        for col in range(ctx):
            pos = col if col < cache else n_past + (col - cache)
            valid = col < n_past if col < cache else (col - cache) <= i
            if col >= cache and n_valid is not None and col - cache >= n_valid:
                valid = False
            if valid and (window is None or q - pos < window):
                out[i, col] = 0.0
    return out


@pytest.mark.parametrize("ar,ctx,n_past,window", [(1, 8, 0, None), (1, 8, 7, 3), (3, 10, 4, None), (3, 10, 7, 2), (4, 12, 5, 4)])
def test_mask_matches_definition(ar, ctx, n_past, window):
    assert np.array_equal(attention_mask(ar, ctx, n_past, window=window)[0, 0], brute(ar, ctx, n_past, window))


@pytest.mark.parametrize(
    "ar,ctx,n_past,window,n_valid",
    [(4, 12, 0, None, 1), (4, 12, 5, None, 3), (4, 12, 5, 3, 2), (6, 16, 10, 4, 5), (4, 12, 8, 2, 3), (3, 9, 6, None, 0)],
)
def test_padded_call_matches_definition(ar, ctx, n_past, window, n_valid):
    """A prefill call with fewer real tokens than ar_len (what the runner builds for the last chunk of a prompt)."""
    got = attention_mask(ar, ctx, n_past, window=window, n_valid=n_valid)[0, 0]
    assert np.array_equal(got, brute(ar, ctx, n_past, window, n_valid))
    # Causality alone keeps padding from the real rows; the n_valid branch is what closes it to the padding rows.
    assert not np.array_equal(got, attention_mask(ar, ctx, n_past, window=window)[0, 0])


def test_n_past_outside_cache_raises():
    with pytest.raises(ValueError, match="outside the cache"):
        attention_mask(4, 8, 5)


@pytest.mark.parametrize("ar,ring,n_past,window,n_valid",
                         [(1, 4, 0, 4, None), (1, 4, 3, 4, None), (1, 4, 11, 4, None), (3, 4, 9, 4, None),
                          (6, 4, 13, 4, 4), (2, 5, 7, 4, None), (8, 8, 21, 8, 5)])
def test_ring_mask_opens_the_same_positions_as_the_full_mask(ar, ring, n_past, window, n_valid):
    """Over a ring, each row attends to exactly the positions the full-length sliding mask opens: slot s holds the
    latest position q < n_past with q % ring == s."""
    ctx = n_past + ar + 1
    full = attention_mask(ar, ctx, n_past, window=window, n_valid=n_valid)[0, 0]
    got = ring_mask(ar, ring, n_past, window=window, n_valid=n_valid)[0, 0]
    assert got.shape == (ar, ring + ar)
    for i in range(ar):
        want = {j for j in range(ctx - ar) if full[i, j] == 0}
        held = {n_past - 1 - (n_past - 1 - s) % ring for s in range(ring) if got[i, s] == 0}
        assert held == want, (i, held, want)
        assert np.array_equal(got[i, ring:], full[i, ctx - ar:])
    assert (got == 0).any() and (got == MASK_MIN).any()


def test_ring_shorter_than_its_window_raises():
    with pytest.raises(ValueError, match="cannot hold a window"):
        ring_mask(1, 2, 5, window=4)


def test_draft_mask_opens_the_past_window_of_the_cache_only():
    """The docstring's picture: position 5, window 2 -> slots 3 and 4; no column of the drafter's own; the ring
    layout opens the slots holding the same positions."""
    assert (draft_mask(7, 5, window=2)[0, 0, 0] == 0).tolist() == [False, False, False, True, True, False]
    assert (draft_mask(7, 5)[0, 0, 0] == 0).tolist() == [True] * 5 + [False]
    ring = draft_mask(7, 5, window=2, ring_len=3)[0, 0, 0]  # slots hold positions 3, 4, 2
    assert ring.shape == (3,) and (ring == 0).tolist() == [True, True, False]
