"""Task arithmetic, magnitude pruning and TIES merging over TaskVectors, per tensor as
`peft.utils.merge_utils` defines them (and equal to it on the same inputs, see tests).

Written here rather than called from peft because peft's functions stack the T tensors of every
parameter (T× memory); these keep running sums and visit the task vectors twice at most."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..taskvector import TaskVector

SIGN_METHODS = ("total", "frequency")


def check_compatible(vectors: Sequence[TaskVector], weights: Sequence[float]) -> None:
    """Raise ValueError unless there is one weight per vector and all vectors share their keys."""
    if not vectors:
        raise ValueError("no task vectors to merge")
    if len(weights) != len(vectors):
        raise ValueError(f"{len(weights)} weights for {len(vectors)} task vectors")
    for tv in vectors[1:]:
        if tv.keys() != vectors[0].keys():
            raise ValueError(f"task vectors disagree on key {sorted(set(tv) ^ set(vectors[0]))[0]!r}")


def task_arithmetic(vectors: Sequence[TaskVector], weights: Sequence[float]) -> TaskVector:
    """Σ_t w_t·τ_t."""
    check_compatible(vectors, weights)
    out = {}
    for key in vectors[0]:
        acc = torch.zeros_like(vectors[0][key])
        for tv, w in zip(vectors, weights):
            acc.add_(tv[key], alpha=float(w))
        out[key] = acc
    return TaskVector(out)


def magnitude_prune(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the top int(density·n) entries of |tensor|, zero the rest (density ≥ 1 keeps all)."""
    if density < 0:
        raise ValueError(f"density must be >= 0, got {density}")
    if density >= 1:
        return tensor
    k = int(density * tensor.numel())
    flat = tensor.reshape(-1)
    mask = torch.zeros_like(flat)
    mask[torch.topk(flat.abs(), k=k).indices] = 1
    return (flat * mask).reshape(tensor.shape)


def ties(
    vectors: Sequence[TaskVector],
    weights: Sequence[float],
    density: float,
    majority_sign_method: str = "total",
    scope: str = "tensor",
) -> TaskVector:
    """TIES: trim each τ_t to `density`, elect the sign per entry from the *unweighted* trimmed
    values (sum for "total", sign count for "frequency"; a tie goes to +), then average the weighted
    agreeing entries over their count (weights act as multipliers, as in peft).

    `scope="tensor"` trims each parameter on its own (peft's `ties`); `scope="model"` keeps the top
    `density` of each task vector as a whole (the TIES paper)."""
    check_compatible(vectors, weights)
    trimmed = [trim(tv, density, scope) for tv in vectors]
    return TaskVector(
        {key: elect_and_merge([t[key] for t in trimmed], weights, majority_sign_method) for key in vectors[0]}
    )


def trim(tv: TaskVector, density: float, scope: str = "tensor") -> TaskVector:
    """Magnitude-trim a task vector per parameter ("tensor") or over all its entries ("model")."""
    if scope == "tensor":
        return TaskVector({k: magnitude_prune(v, density) for k, v in tv.items()})
    if scope == "model":
        return TaskVector.unflatten(magnitude_prune(tv.flatten(), density), tv)
    raise ValueError(f"scope must be 'tensor' or 'model', got {scope!r}")


def elect_and_merge(trimmed: Sequence[torch.Tensor], weights: Sequence[float], method: str = "total") -> torch.Tensor:
    """The sign election and disjoint mean of TIES on one parameter's already-trimmed task tensors."""
    if method not in SIGN_METHODS:
        raise ValueError(f"majority_sign_method must be one of {SIGN_METHODS}, got {method!r}")
    vote = torch.zeros_like(trimmed[0])
    for t in trimmed:
        vote += t if method == "total" else t.sign()
    majority = torch.where(vote >= 0, 1.0, -1.0).to(vote.dtype)
    total = torch.zeros_like(vote)
    count = torch.zeros_like(vote)
    for t, w in zip(trimmed, weights):
        agree = (t.sign() == majority).to(t.dtype)
        total += t * float(w) * agree
        count += agree
    return total / count.clamp(min=1.0)


def sign_similarity(vectors: Sequence[TaskVector]) -> torch.Tensor:
    """MaTU Eq. 5: S[t, t'] = ½·(mean_j sgn(τ_t[j])·sgn(τ_t'[j]) + 1), a T×T matrix in [0, 1]."""
    signs = torch.stack([tv.flatten().sign() for tv in vectors])
    return 0.5 * (signs @ signs.T / signs.shape[1] + 1.0)


def agreement_mask(vectors: Sequence[TaskVector], rho: float = 0.4) -> TaskVector:
    """MaTU Eq. 3 (from Gradient Masked Averaging): α[j] = |mean_n sgn(τ_n[j])|; the soft mask is 1
    where α ≥ ρ and α elsewhere, so disagreeing entries are scaled down, not dropped."""
    check_compatible(vectors, [1.0] * len(vectors))
    out = {}
    for key in vectors[0]:
        alpha = sum(tv[key].sign() for tv in vectors).abs() / len(vectors)
        out[key] = torch.where(alpha >= rho, torch.ones_like(alpha), alpha)
    return TaskVector(out)
