"""DARE (Yu et al., 2024): drop each entry with probability 1−density and rescale survivors by
1/density, then add (`dare_linear`) or TIES-merge (`dare_ties`). Seeded with a torch.Generator;
the same seed gives peft's result when peft runs under `torch.manual_seed(seed)`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..taskvector import TaskVector
from .ties import check_compatible, elect_and_merge, task_arithmetic


def random_prune(tensor: torch.Tensor, density: float, generator: torch.Generator, rescale: bool = True) -> torch.Tensor:
    """Keep each entry with probability `density` (Bernoulli), divided by `density` if `rescale`."""
    if not 0 < density <= 1:
        raise ValueError(f"DARE density must be in (0, 1], got {density}")
    mask = torch.bernoulli(torch.full_like(tensor, density), generator=generator)
    pruned = tensor * mask
    return pruned / density if rescale else pruned


def _dropped(vectors: Sequence[TaskVector], density: float, seed: int) -> list[TaskVector]:
    gen = torch.Generator().manual_seed(seed)
    out: list[dict] = [{} for _ in vectors]
    for key in vectors[0]:  # key-major order: the order in which per-parameter merges draw
        for i, tv in enumerate(vectors):
            out[i][key] = random_prune(tv[key], density, gen)
    return [TaskVector(d) for d in out]


def dare_linear(vectors: Sequence[TaskVector], weights: Sequence[float], density: float, seed: int = 0) -> TaskVector:
    check_compatible(vectors, weights)
    return task_arithmetic(_dropped(vectors, density, seed), weights)


def dare_ties(vectors: Sequence[TaskVector], weights: Sequence[float], density: float, seed: int = 0,
              majority_sign_method: str = "total") -> TaskVector:
    check_compatible(vectors, weights)
    dropped = _dropped(vectors, density, seed)
    return TaskVector({key: elect_and_merge([d[key] for d in dropped], weights, majority_sign_method)
                       for key in vectors[0]})
