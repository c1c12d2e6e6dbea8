"""Rotary position embedding applied from precomputed cos/sin tables (pure tensor math)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Swap the two halves of the last dim, negating the second: the pairing of transformers' RoPE."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def gather_rope(cos_table: torch.Tensor, sin_table: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Look up the rows of ``[max_pos, head_dim]`` tables at ``input_pos`` ``[1, ar]``; returns ``[1, ar, 1, head_dim]``.

    The trailing singleton broadcasts over heads of ``[1, ar, heads, head_dim]`` activations.
    """
    pos = input_pos.reshape(-1).long()
    cos = torch.index_select(cos_table, 0, pos)
    sin = torch.index_select(sin_table, 0, pos)
    ar = pos.shape[0]
    return cos.view(1, ar, 1, -1), sin.view(1, ar, 1, -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[1, ar, heads, head_dim]`` by tables from :func:`gather_rope`.

    Partial ("proportional") RoPE needs no special case: its tables hold cos=1, sin=0 on the dims that are not
    rotated, so those pass through unchanged.
    """
    return x * cos + rotate_half(x) * sin
