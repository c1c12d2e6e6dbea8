"""Additive attention masks for the static graph (pure tensor math, no model knowledge).

The static graph attends over C = context_len columns: the first C - ar_len columns are cache slots
(slot j holds position j), the last ar_len columns are the tokens of the current call, whose K/V are
appended inside the graph. A mask value of 0 means "attend", MASK_MIN means "masked".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Large enough that exp(MASK_MIN) vanishes next to any attended score, small enough to stay finite in fp16
# and to quantize exactly at 16 bits (0 -> 65535, MASK_MIN -> 0 with scale 255/65535): the same value
# ExecuTorch's Qualcomm LLM flow uses, so its runners can be reused.
MASK_MIN = -255.0


def attention_mask(
    ar_len: int,
    context_len: int,
    n_past: int,
    *,
    window: int | None = None,
    n_valid: int | None = None,
    dtype: "np.typing.DTypeLike" = np.float32,
) -> np.ndarray:
    """Build the additive mask of one call.

    Row i is the token at position ``n_past + i``. Cache column j (< C - ar_len) holds position j and is open
    when ``j < n_past`` (and, with a window, when ``n_past + i - j < window``). Column ``C - ar_len + c`` is the
    current call's token c and is open when ``c <= i`` (and ``i - c < window``).

    Example: ar_len=2, context_len=6, n_past=2, window=None (``x`` attend, ``.`` masked)::

                cache slots   | new
        row 0:  x  x  .  .    | x  .
        row 1:  x  x  .  .    | x  x

    With window=2 the oldest visible cache slot slides right::

        row 0:  .  x  .  .    | x  .
        row 1:  .  .  .  .    | x  x

    Args:
        ar_len: tokens per call.
        context_len: C, cache slots plus ar_len.
        n_past: tokens already in the cache (slots ``[0, n_past)``).
        window: sliding-window size (a token sees itself and the ``window - 1`` tokens before it), or None.
        n_valid: rows beyond this count are padding; their columns are kept closed for the real rows
            (padding only follows real tokens, so causality already guarantees that).
        dtype: floating numpy dtype of the result.

    Returns:
        A ``[1, 1, ar_len, context_len]`` array of 0 / MASK_MIN (numpy: the runtime builds masks without torch; the
        exporter wraps it with ``torch.from_numpy``).
    """
    cache_len = context_len - ar_len
    if n_past < 0 or n_past > cache_len:
        raise ValueError(f"n_past={n_past} is outside the cache of {cache_len} slots")
    rows = np.arange(ar_len)[:, None]  # i
    slots = np.arange(cache_len)[None, :]  # j
    cols = np.arange(ar_len)[None, :]  # c
    open_cache = slots < n_past
    open_new = cols <= rows
    if window is not None:
        open_cache = open_cache & ((n_past + rows - slots) < window)
        open_new = open_new & ((rows - cols) < window)
    if n_valid is not None:
        open_new = open_new & (cols < n_valid)
    allowed = np.concatenate([np.broadcast_to(open_cache, (ar_len, cache_len)), open_new], axis=1)
    mask = np.where(allowed, 0.0, MASK_MIN).astype(dtype)
    return mask.reshape(1, 1, ar_len, context_len)


def ring_mask(
    ar_len: int,
    ring_len: int,
    n_past: int,
    *,
    window: int,
    n_valid: int | None = None,
    dtype: "np.typing.DTypeLike" = np.float32,
) -> np.ndarray:
    """The additive sliding-window mask of one call over a ring cache: ``ring_len`` slots, then the call's tokens.

    Position p lives in slot ``p % ring_len``; after ``n_past`` tokens, slot s holds the latest position
    ``q < n_past`` with ``q % ring_len == s`` (none when ``q < 0``). Row i (position ``n_past + i``) attends to slot s
    when q exists and ``n_past + i - q < window``, and to its own column c when ``c <= i`` and ``i - c < window``.
    RoPE was applied to each K at its own position before it was stored, so the slots' order does not matter.

    Example: ring_len=window=3, n_past=4, ar_len=2 (slots hold positions 3, 1, 2; ``x`` attend, ``.`` masked)::

                ring: q=3 q=1 q=2 | new
        row 0 (p=4):  x   .   x   | x  .
        row 1 (p=5):  x   .   .   | x  x

    Args:
        ar_len: tokens per call.
        ring_len: slots of the ring (at least ``window - 1``, so that every row finds its window).
        n_past: tokens already written, the last ``ring_len`` of them in the ring.
        window: sliding-window size (a token sees itself and the ``window - 1`` tokens before it).
        n_valid: rows beyond this count are padding; their columns stay closed.
        dtype: floating numpy dtype of the result.

    Returns:
        A ``[1, 1, ar_len, ring_len + ar_len]`` array of 0 / MASK_MIN.
    """
    if ring_len < window - 1:
        raise ValueError(f"A ring of {ring_len} slots cannot hold a window of {window} tokens")
    if n_past < 0:
        raise ValueError(f"n_past={n_past} must be >= 0")
    rows = np.arange(ar_len)[:, None]
    slots = np.arange(ring_len)[None, :]
    held = n_past - 1 - np.mod(n_past - 1 - slots, ring_len)  # the position in each slot (< 0: never written)
    open_ring = (held >= 0) & ((n_past + rows - held) < window)
    cols = np.arange(ar_len)[None, :]
    open_new = (cols <= rows) & ((rows - cols) < window)
    if n_valid is not None:
        open_new = open_new & (cols < n_valid)
    allowed = np.concatenate([open_ring, open_new], axis=1)
    return np.where(allowed, 0.0, MASK_MIN).astype(dtype).reshape(1, 1, ar_len, ring_len + ar_len)


def tree_mask(
    parents: "list[int]",
    offsets: "list[int]",
    ar_len: int,
    context_len: int,
    n_past: int,
    *,
    window: int | None = None,
    dtype: "np.typing.DTypeLike" = np.float32,
) -> np.ndarray:
    """The additive mask of one call whose tokens form a tree (lookahead decoding's guesses).

    Row i sits at position ``n_past + offsets[i]`` and continues row ``parents[i]`` (-1: it continues the cache
    only). It attends to the cache slots ``[0, n_past)``, to itself and to its ancestors' columns, and with a window
    only to those less than ``window`` positions before it. Rows beyond ``len(parents)`` are padding: cache and self.

    Example: parents [-1, 0, 0], offsets [0, 1, 1], n_past=2, context_len=7, ar_len=3 (two guesses for one
    position, each continuing row 0)::

                cache slots  | new
        row 0:  x  x  .  .   | x  .  .
        row 1:  x  x  .  .   | x  x  .
        row 2:  x  x  .  .   | x  .  x

    Returns:
        A ``[1, 1, ar_len, context_len]`` array of 0 / MASK_MIN.
    """
    cache_len = context_len - ar_len
    if n_past < 0 or n_past > cache_len:
        raise ValueError(f"n_past={n_past} is outside the cache of {cache_len} slots")
    if len(parents) > ar_len or len(offsets) != len(parents):
        raise ValueError(f"A tree of {len(parents)} rows ({len(offsets)} offsets) does not fit a call of {ar_len}")
    pos = np.zeros(ar_len, dtype=np.int64)
    pos[: len(offsets)] = offsets
    allowed = np.zeros((ar_len, context_len), dtype=bool)
    allowed[:, :n_past] = True
    for i in range(ar_len):
        row = i
        while row >= 0:  # the row itself, then its ancestors
            allowed[i, cache_len + row] = True
            row = parents[row] if row < len(parents) else -1
            if row >= i:
                raise ValueError(f"Row {i}'s ancestor {row} does not come before it")
    if window is not None:
        col_pos = np.concatenate([np.arange(cache_len) - n_past, pos])  # relative to n_past
        allowed &= (pos[:, None] - col_pos[None, :]) < window
    return np.where(allowed, 0.0, MASK_MIN).astype(dtype).reshape(1, 1, ar_len, context_len)


def window_band(ar_len: int, context_len: int, window: int, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """The sliding window among one call's own tokens: MASK_MIN where row i meets column ``C - ar_len + c`` with
    ``i - c >= window``, 0 everywhere else (every cache column included).

    ``torch.where(band < 0, band, mask)`` closes, in any mask, the call's own columns that lie outside the window
    and leaves the rest as it was (a select rather than ``torch.minimum``, which the HTP has no 8-bit kernel for). ExecuTorch's ``qnn_llama_runner`` opens a call's own columns causally and applies
    the window to past columns only (``KVManager::init_attention_mask``), so a prefill graph whose call is longer than
    the window applies this band itself; with ``ar_len <= window`` the band is all zeros and is never built.
    """
    import torch  # a graph constant of the exporter: the runtime never builds it

    rows = torch.arange(ar_len).unsqueeze(1)
    cols = torch.arange(ar_len).unsqueeze(0)
    band = torch.zeros((ar_len, context_len), dtype=dtype or torch.float32)
    band[:, context_len - ar_len :].masked_fill_((rows - cols) >= window, MASK_MIN)
    return band.view(1, 1, ar_len, context_len)


def draft_mask(
    context_len: int,
    n_past: int,
    *,
    window: int | None = None,
    ring_len: int | None = None,
    dtype: "np.typing.DTypeLike" = np.float32,
) -> np.ndarray:
    """The one-row additive mask of an MTP drafter step over the target's decode-sized caches.

    The drafter (Gemma 4's assistant) writes no K/V of its own: at position ``n_past`` it reads the target's K/V of
    positions ``[0, n_past)``, and with a window only the last ``window`` of them, ``|n_past - q| <= window``
    (transformers' bidirectional sliding window). Example: context_len=7, n_past=5, window=2 (``x`` attend)::

        cache slots (position j):  0  1  2  3  4  5
                                   .  .  .  x  x  .

    Args:
        context_len: C of the target; its decode caches hold ``C - 1`` slots.
        n_past: the drafter's position, the count of target positions in the cache.
        window: the drafter's sliding window, or None for a full-attention layer.
        ring_len: the slots of the target's sliding ring cache (`CacheLayout.RING`), or None for the full layout.
        dtype: floating numpy dtype of the result.

    Returns:
        ``[1, 1, 1, C - 1]`` (or ``[1, 1, 1, ring_len]``) of 0 / MASK_MIN: the cache columns only.
    """
    wide = None if window is None else window + 1  # the masks above count the query itself inside the window
    if ring_len is not None:
        if wide is None:
            raise ValueError("A ring cache only holds a sliding layer's K/V: give its window")
        mask = ring_mask(1, ring_len, n_past, window=wide, dtype=dtype)
    else:
        mask = attention_mask(1, context_len, n_past, window=wide, dtype=dtype)
    return np.ascontiguousarray(mask[..., :-1])
