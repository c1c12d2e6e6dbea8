"""Logits of the tokens of a few best clusters only, the rest floored (pure tensor math)."""

from __future__ import annotations

import torch


def clustered_logits(
    hidden: torch.Tensor, centroids: torch.Tensor, ordering: torch.Tensor, table: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Score only the tokens of the ``top_k`` clusters closest to ``hidden``; every other token gets the lowest
    score minus one (so an argmax, or a softmax, never picks one).

    The vocabulary is split into ``n`` equal clusters: row c of ``ordering.view(n, -1)`` lists the token ids of
    cluster c. ``top_k`` clusters of ``hidden @ centroids.T`` are chosen, the ``top_k * vocab / n`` rows of ``table``
    of their tokens are gathered and scored, and scattered back to their ids.

    Args:
        hidden: ``[1, ar, d]``.
        centroids: ``[n, d]``.
        ordering: ``[vocab]`` token ids, cluster by cluster.
        table: ``[vocab, d]``, the output embedding.
        top_k: clusters scored.

    Returns:
        ``[1, ar, vocab]``.
    """
    n = centroids.shape[0]
    vocab, d = table.shape
    ar = hidden.shape[1]
    _, best = torch.topk(torch.matmul(hidden, centroids.t()), top_k, dim=-1)  # [1, ar, top_k]
    ids = torch.index_select(ordering.long().view(n, vocab // n), 0, best.reshape(-1)).view(1, ar, -1)
    rows = torch.index_select(table, 0, ids.reshape(-1)).view(1, ar, -1, d)
    scores = torch.matmul(rows, hidden.unsqueeze(-1)).squeeze(-1)  # [1, ar, top_k * vocab / n]
    floor = torch.amin(scores) - 1.0
    return torch.full((1, ar, vocab), 0.0, dtype=hidden.dtype).add(floor).scatter(-1, ids, scores)
