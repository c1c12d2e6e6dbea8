"""Grouped-query attention over a static, explicitly passed KV cache (pure tensor math)."""

from __future__ import annotations

import torch


def matmul_operand(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` (a graph input) as an attention matmul may read it: ``cache + 0.0``.

    A graph input must not feed a matmul directly. QnnQuantizer gives a 16-bit matmul's second operand a symmetric
    int16 encoding, which a uint16 cache buffer (its host encoding, asymmetric) does not have, and the HTP's MatMul
    takes no other: with integer IO the input then took the operand's encoding ("No unsigned IO dtype for [-32767,
    32767]"), and a Gemma 4 assistant's caches, observed with the target's encodings, failed QNN's validation
    (error 3110). Observing the input as a uint16 activation instead compiles, but `to_executorch`'s spec propagation
    re-runs the delegate's float graph on fake uint16 inputs, where `matmul` does not promote ("expected scalar type
    torch.float32 but found torch.uint16"). The add keeps the input's encoding and gives its output the matmul's, as
    the full layout's `cat` does. Measured cost (window-7 demo, 16a8w, ctx 64, blocks of 16): 868 / 866 ops handed to
    QNN per method against 844 / 842 without it, the same HTP op data (174592 / 145152 bytes) and constants.
    """
    return cache + 0.0


def static_gqa(
    query: torch.Tensor,
    key_t: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Attention whose query heads share KV heads, with no `repeat_kv` copy.

    Query heads ``h * n_rep ... (h + 1) * n_rep - 1`` read KV head ``h`` (the grouping of transformers'
    ``repeat_kv``). The grouping is folded into the row dimension so every tensor stays 4-D, which the HTP
    handles best.

    Args:
        query: ``[1, heads, ar, head_dim]``.
        key_t: keys stored transposed, ``[1, kv_heads, head_dim, T]``.
        value: ``[1, kv_heads, T, head_dim]``.
        mask: additive ``[1, 1, ar, T]``.
        scaling: multiplier of the scores.

    Returns:
        ``[1, ar, heads * head_dim]``.
    """
    _, heads, ar, head_dim = query.shape
    kv_heads = key_t.shape[1]
    t = key_t.shape[-1]
    n_rep = heads // kv_heads
    q = query.reshape(1, kv_heads, n_rep * ar, head_dim)
    scores = torch.matmul(q, key_t)
    if scaling != 1.0:
        scores = scores * scaling
    scores = scores.view(1, heads, ar, t) + mask
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(1, kv_heads, n_rep * ar, t), value)
    return out.view(1, heads, ar, head_dim).transpose(1, 2).reshape(1, ar, heads * head_dim)


def blocked_gqa(
    query: torch.Tensor,
    key_t_blocks: list[torch.Tensor],
    value_blocks: list[torch.Tensor],
    mask: torch.Tensor,
    scaling: float = 1.0,
) -> torch.Tensor:
    """`static_gqa` over a KV cache cut into column blocks, never joining the blocks into one tensor.

    The scores of each block are computed on their own and joined (``[.., ar, T]``, as `static_gqa` makes them), the
    mask and one softmax apply to all columns at once, and the output sums each block's probabilities times its
    values. The same math as `static_gqa` on the joined cache, up to float rounding of the sum's order; what differs
    is that no tensor of the graph holds a whole cache, so each block may enter the graph as an input of its own
    (`CacheLayout.BLOCKS`).

    Args:
        query: ``[1, heads, ar, head_dim]``.
        key_t_blocks: keys stored transposed, ``[1, kv_heads, head_dim, T_b]`` each, in column order.
        value_blocks: ``[1, kv_heads, T_b, head_dim]`` each, the same columns as ``key_t_blocks``.
        mask: additive ``[1, 1, ar, sum(T_b)]``.
        scaling: multiplier of the scores.

    Returns:
        ``[1, ar, heads * head_dim]``.
    """
    _, heads, ar, head_dim = query.shape
    kv_heads = key_t_blocks[0].shape[1]
    n_rep = heads // kv_heads
    q = query.reshape(1, kv_heads, n_rep * ar, head_dim)
    scores = torch.cat([torch.matmul(q, k) for k in key_t_blocks], dim=-1)
    t = scores.shape[-1]
    if scaling != 1.0:
        scores = scores * scaling
    probs = torch.softmax(scores.view(1, heads, ar, t) + mask, dim=-1).view(1, kv_heads, n_rep * ar, t)
    out = None
    start = 0
    for v in value_blocks:
        end = start + v.shape[-2]
        part = torch.matmul(probs[..., start:end], v)
        out = part if out is None else out + part
        start = end
    return out.view(1, heads, ar, head_dim).transpose(1, 2).reshape(1, ar, heads * head_dim)
