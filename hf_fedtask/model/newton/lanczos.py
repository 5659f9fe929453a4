"""Eigenpairs of a symmetric positive semi-definite operator v ↦ A·v over `TaskVector`s by Lanczos with
full reorthogonalization: `largest_eigenvalue`, λ_max(A), the scale F²L²'s default damping λ = ρ·λ_max is set
against, and `curvature_factor`, A's top eigenpairs as the rows of a factor F with FᵀF ≈ A (what F²L²'s
clients upload and its server keeps of H_s; `hf_fedtask.model.newton.lowrank` turns such factors into
operators and preconditioners).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_fedtask.core.taskvector import TaskVector


@dataclass
class EigenInfo:
    """How `largest_eigenvalue` ended: products taken and the last relative change of the estimate."""

    iterations: int
    relative_change: float


def _lanczos(apply: Callable[[TaskVector], TaskVector], template: TaskVector, steps: int, seed: int,
             tolerance: float | None = None) -> tuple[torch.Tensor, dict, torch.Tensor, EigenInfo]:
    """Lanczos with full reorthogonalization from a seeded random start: (the orthonormal basis as the rows
    of a float32 matrix over the flattened parameters, their shapes by name, the tridiagonal T = QᵀAQ in
    float64, how it ended). Stops after `steps` products, at an invariant subspace, or (`tolerance`) when T's
    top eigenvalue changes by at most that (relative). The basis is one matrix, so reorthogonalizing against
    it is two matrix products, not a loop over vectors."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {k: t.shape for k, t in template.items()}
    q = torch.cat([torch.randn(shape, generator=generator, dtype=torch.float32).reshape(-1)
                   for shape in shapes.values()])
    basis = torch.empty((steps, q.numel()), dtype=torch.float32)
    basis[0] = q / q.norm()
    alphas, betas = [], []
    estimate, change, done = 0.0, float("inf"), 0
    for done in range(1, steps + 1):
        q = basis[done - 1]
        out = apply(TaskVector.unflatten(q, shapes))
        w = TaskVector({k: out[k] for k in shapes}).flatten().float()
        alphas.append(float(w.double() @ q.double()))
        kept = basis[:done]
        for _ in range(2):  # twice: the basis stays orthonormal in float32 over hundreds of steps
            w = w - kept.T @ (kept @ w)
        beta = float(w.double().norm())
        if tolerance is not None:
            ritz = float(torch.linalg.eigvalsh(_tridiagonal(alphas, betas))[-1])
            change, estimate = abs(ritz - estimate) / max(abs(ritz), 1e-30), ritz
            if change <= tolerance:
                break
        if done == steps or beta <= 1e-6 * max(abs(a) for a in alphas):  # an invariant subspace
            break
        betas.append(beta)
        basis[done] = w / beta
    return basis[:len(alphas)], shapes, _tridiagonal(alphas, betas), EigenInfo(done, change)


def largest_eigenvalue(apply: Callable[[TaskVector], TaskVector], template: TaskVector, *, iterations: int = 30,
                       tolerance: float = 1e-4, seed: int = 0) -> tuple[float, EigenInfo]:
    """λ_max of a symmetric positive semi-definite A given as `apply`, shaped like `template`: Lanczos with
    full reorthogonalization from a seeded random start (the Krylov space power iteration explores, read
    through its best Ritz value instead of the last iterate, so a small gap λ₁/λ₂ costs far fewer products).
    Stops when the top Ritz value changes by at most `tolerance` (relative) or after `iterations` products;
    the estimate never exceeds the true λ_max."""
    _, _, t, info = _lanczos(apply, template, iterations, seed, tolerance)
    return float(torch.linalg.eigvalsh(t)[-1]), info


def curvature_factor(apply: Callable[[TaskVector], TaskVector], template: TaskVector, rank: int, *,
                     oversample: int = 20, seed: int = 0) -> TaskVector:
    """F with FᵀF ≈ A, the top `rank` eigenpairs of a symmetric positive semi-definite A given as `apply`:
    F's rows are √h_i·v_i (a row per eigenpair, largest first; saved name -> tensor of shape (rank, *shape),
    zero rows where A has fewer eigenvalues above 1e-6 of its largest), from the Ritz pairs of `rank` +
    `oversample` Lanczos steps (the extra steps converge the lowest pairs kept). A's best rank-`rank`
    approximation in every unitarily invariant norm, to Lanczos' accuracy."""
    basis, shapes, t, _ = _lanczos(apply, template, rank + oversample, seed)
    values, vectors = torch.linalg.eigh(t)
    order = values.argsort(descending=True)[:rank]
    kept = values[order]
    scales = torch.where(kept > 1e-6 * kept[0], kept, 0.0).sqrt()  # below: float32 round-off, not curvature
    ritz = (vectors[:, order].T @ basis.double()) * scales[:, None]  # (kept, P): √h_i·v_i
    padded = torch.zeros((rank, basis.shape[1]), dtype=torch.float32)
    padded[:len(order)] = ritz.float()
    return TaskVector({k: chunk.reshape(rank, *shape) for (k, shape), chunk in
                       zip(shapes.items(), padded.split([math.prod(shape) for shape in shapes.values()], 1))})


def _tridiagonal(alphas: list[float], betas: list[float]) -> torch.Tensor:
    """The Lanczos matrix T with diagonal `alphas` and off-diagonal `betas` (float64)."""
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas[:len(alphas) - 1], dtype=torch.float64)
        t = t + torch.diag(off, 1) + torch.diag(off, -1)
    return t
