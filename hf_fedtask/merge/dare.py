"""DARE (Yu et al., 2024): drop each entry with probability 1−density and rescale survivors by
1/density, then add (`dare_linear`) or TIES-merge (`dare_ties`). Seeded with a torch.Generator;
the same seed gives peft's result when peft runs under `torch.manual_seed(seed)`.

peft's per-parameter merges draw the masks key by key, task by task, so both functions work one key
at a time in that order: `dare_linear` keeps a running sum (O(d) memory), `dare_ties` holds the N
dropped tensors of one key (O(N·largest key)); neither holds N dropped vectors.

The masks are always drawn by torch (`torch.bernoulli`, in peft's order and memory layout), so the
random stream is peft's. With float32 vectors the arithmetic around them is fused (`kernels`):
`dare_linear` drops, rescales and adds each task in one pass, and `dare_ties` runs TIES' fused
election and disjoint mean (no trimming) over the dropped tensors. The torch path is the reference;
both give the same result bit for bit."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge import kernels
from hf_fedtask.merge.streaming import Layout
from hf_fedtask.merge.ties import check_compatible, elect_and_merge, ties


def random_prune(tensor: torch.Tensor, density: float, generator: torch.Generator, rescale: bool = True) -> torch.Tensor:
    """Keep each entry with probability `density` (Bernoulli), divided by `density` if `rescale`."""
    _check_density(density)
    mask = _keep_mask(tensor, density, generator)
    pruned = tensor * mask
    return pruned / density if rescale else pruned


def dare_linear(vectors: Sequence[TaskVector], weights: Sequence[float], density: float, seed: int = 0,
                backend: str = "auto") -> TaskVector:
    """Σ_t w_t·drop(τ_t), summed as `task_arithmetic` sums. `backend` as in `ties`."""
    check_compatible(vectors, weights)
    _check_density(density)
    fused = kernels.use_kernels(backend, Layout(vectors))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key in vectors[0]:
        if fused:
            acc = torch.zeros(vectors[0][key].numel(), dtype=torch.float32)
            for tv, w in zip(vectors, weights):
                keep = _keep_mask(tv[key], density, gen)
                kernels.add_dropped(acc, tv[key].reshape(-1), keep.reshape(-1), density, float(w))
            out[key] = acc.reshape(vectors[0][key].shape)
        else:
            acc = torch.zeros_like(vectors[0][key])
            for tv, w in zip(vectors, weights):
                acc.add_(random_prune(tv[key], density, gen), alpha=float(w))
            out[key] = acc
    return TaskVector(out)


def dare_ties(vectors: Sequence[TaskVector], weights: Sequence[float], density: float, seed: int = 0,
              majority_sign_method: str = "total", backend: str = "auto") -> TaskVector:
    """TIES' election and disjoint mean over the dropped task vectors. `backend` as in `ties`."""
    check_compatible(vectors, weights)
    _check_density(density)
    fused = kernels.use_kernels(backend, Layout(vectors))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key in vectors[0]:
        if fused:
            dropped = [TaskVector({key: kernels.drop(tv[key].reshape(-1), _keep_mask(tv[key], density, gen).reshape(-1),
                                                     density)}) for tv in vectors]
            out[key] = ties(dropped, weights, 1.0, majority_sign_method, backend="numba")[key].reshape(vectors[0][key].shape)
        else:
            out[key] = elect_and_merge([random_prune(tv[key], density, gen) for tv in vectors], weights,
                                       majority_sign_method)
    return TaskVector(out)


def _keep_mask(tensor: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """Bernoulli(density) draws shaped (and strided) like `tensor`: the draws peft makes, in its order."""
    return torch.bernoulli(torch.full_like(tensor, density), generator=generator)


def _check_density(density: float) -> None:
    if not 0 < density <= 1:
        raise ValueError(f"DARE density must be in (0, 1], got {density}")
