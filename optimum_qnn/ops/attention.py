"""Grouped-query attention over a static, explicitly passed KV cache (pure tensor math)."""

from __future__ import annotations

import torch


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
