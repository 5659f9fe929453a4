"""DARE (Yu et al., 2024): drop each entry with probability 1−density and rescale survivors by
1/density, then add (`dare_linear`) or TIES-merge (`dare_ties`). Seeded with a torch.Generator;
the same seed gives peft's result when peft runs under `torch.manual_seed(seed)`.

peft's per-parameter merges draw the masks key by key, task by task, so both functions work one key
at a time in that order: `dare_linear` keeps a running sum (O(d) memory), `dare_ties` holds the N
dropped tensors of one key (O(N·largest key)); neither holds N dropped vectors.

Vectors on an accelerator are merged there: the masks are still drawn from the seeded CPU generator
(so the same seed drops the same entries on every device) and moved to the tensors, and the results
stay there; CPU vectors are merged exactly as before."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge.ties import check_compatible, elect_and_merge


def random_prune(tensor: torch.Tensor, density: float, generator: torch.Generator,
                 rescale: bool = True) -> torch.Tensor:
    """Keep each entry with probability `density` (Bernoulli), divided by `density` if `rescale`. The
    mask is drawn on the generator's device and moved to the tensor's."""
    if not 0 < density <= 1:
        raise ValueError(f"DARE density must be in (0, 1], got {density}")
    mask = torch.bernoulli(torch.full_like(tensor, density, device=generator.device), generator=generator)
    pruned = tensor * mask.to(tensor.device)
    return pruned / density if rescale else pruned


def dare_linear(vectors: Sequence[TaskVector], weights: Sequence[float], density: float, seed: int = 0) -> TaskVector:
    """Σ_t w_t·drop(τ_t), summed as `task_arithmetic` sums."""
    check_compatible(vectors, weights)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key in vectors[0]:
        acc = torch.zeros_like(vectors[0][key])
        for tv, w in zip(vectors, weights):
            acc.add_(random_prune(tv[key], density, gen), alpha=float(w))
        out[key] = acc
    return TaskVector(out)


def dare_ties(vectors: Sequence[TaskVector], weights: Sequence[float], density: float, seed: int = 0,
              majority_sign_method: str = "total") -> TaskVector:
    """TIES' election and disjoint mean over the dropped task vectors."""
    check_compatible(vectors, weights)
    gen = torch.Generator().manual_seed(seed)
    return TaskVector({key: elect_and_merge([random_prune(tv[key], density, gen) for tv in vectors], weights,
                                            majority_sign_method) for key in vectors[0]})
