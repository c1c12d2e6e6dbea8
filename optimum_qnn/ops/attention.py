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
