"""Weighted averaging of task vectors, streamed: one running sum, never a stack of N vectors."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hf_fedtask.core.taskvector import TaskVector


def weighted_average(vectors: Iterable[TaskVector], weights: Iterable[float]) -> TaskVector:
    """Σ w_i·τ_i / Σ w_i, accumulated in float64 and returned in the inputs' dtype.

    Memory is O(d) however many vectors stream in (they may come from a generator that reads
    files). Raises ValueError on no inputs, non-positive total weight or mismatched keys."""
    acc: dict[str, torch.Tensor] | None = None
    dtypes: dict[str, torch.dtype] = {}
    total = 0.0
    for tv, w in zip(vectors, weights, strict=True):
        if acc is None:
            acc = {k: torch.zeros(t.shape, dtype=torch.float64) for k, t in tv.items()}
            dtypes = {k: t.dtype for k, t in tv.items()}
        if tv.keys() != acc.keys():
            missing = sorted(set(acc) ^ set(tv))
            raise ValueError(f"task vectors disagree on key {missing[0]!r}")
        for k, t in tv.items():
            acc[k].add_(t.to(torch.float64), alpha=float(w))
        total += float(w)
    if acc is None:
        raise ValueError("weighted_average of no task vectors")
    if total <= 0:
        raise ValueError(f"total weight must be positive, got {total}")
    return TaskVector({k: (v / total).to(dtypes[k]) for k, v in acc.items()})
