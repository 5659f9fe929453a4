"""Operators and inverses built from curvature factors (`hf_fedtask.model.newton.lanczos.curvature_factor`:
rows √h·v over the trainable parameters). `LowRankGaussNewton` is a Hessian H ≈ Σ_j c_j·F_jᵀF_j from the
factors F²L²'s clients upload, and `LowRankInverse` its exact inverse (H + λI)⁻¹ by Woodbury;
`SpectralPreconditioner` is exact on one factor's span and λI beyond it (the server's factor of H_s). As
preconditioners of `hf_fedtask.model.newton.solvers.conjugate_gradient` they make CG take a few iterations
where a long-tailed H at a small λ takes a hundred.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

from hf_fedtask.core.taskvector import TaskVector


class SpectralPreconditioner:
    """M⁻¹ = V·diag(1/(θ_i + λ))·Vᵀ + (I − VVᵀ)/λ for (A + λI), from a curvature factor of A
    (`curvature_factor`'s rows f_i = √θ_i·v_i, orthonormal v_i): exact on the factor's span and λI beyond it,
    so preconditioned CG sees a condition number of at most 1 + θ_min/λ (θ_min the smallest eigenvalue kept)
    instead of 1 + λ_max/λ. Symmetric positive definite for any λ > 0 whatever the factor's accuracy, so CG
    stays exact; only its speed depends on how well the factor captures A's top. Applied through the rows
    as stored, per parameter tensor (v_i·v_iᵀ = f_i·f_iᵀ/θ_i; zero rows contribute nothing):
    M⁻¹·r = r/λ + Σ_i f_i·(f_i·r)·(1/(θ_i + λ) − 1/λ)/θ_i."""

    def __init__(self, factor: TaskVector):
        self.rows = {k: t.reshape(t.shape[0], -1) for k, t in factor.items()}  # (m, p_k) views, no copy
        self.values = sum(torch.linalg.vector_norm(t, dim=1, dtype=torch.float64) ** 2 for t in self.rows.values())

    @property
    def largest(self) -> float:
        """θ₁, the factor's largest eigenvalue (A's λ_max to Lanczos' accuracy)."""
        return float(self.values.max()) if len(self.values) else 0.0

    def __call__(self, r: TaskVector, damping: float) -> TaskVector:
        if damping <= 0:
            raise ValueError("SpectralPreconditioner needs damping > 0 (M⁻¹ divides by λ beyond the factor's span)")
        kept = self.values > 0
        scale = torch.zeros_like(self.values)
        theta = self.values[kept]
        scale[kept] = (1.0 / (theta + damping) - 1.0 / damping) / theta
        coefficients = sum(rows @ r[k].reshape(-1).float() for k, rows in self.rows.items())  # F·r
        weighted = (coefficients.double() * scale).float()
        return TaskVector({k: (r[k].reshape(-1) / damping + rows.T @ weighted).reshape(r[k].shape)
                           for k, rows in self.rows.items()})


class LowRankGaussNewton:
    """v ↦ Σ_j c_j·F_jᵀ(F_j·v) for curvature factors F_j (`curvature_factor`'s layout) and weights c_j: a
    Hessian H ≈ Σ_j c_j·H_j built from factors the clients uploaded, as a context manager like `hessian`'s
    operators. The factors are stacked once into one P × Σ rank matrix; a product is two matrix products."""

    def __init__(self, factors: list[tuple[TaskVector, float]]):
        self.factors = factors

    def __enter__(self) -> LowRankGaussNewton:
        first = self.factors[0][0]
        self.shapes = {k: first[k].shape[1:] for k in first}
        sizes = [math.prod(shape) for shape in self.shapes.values()]
        self.ranks = [f[next(iter(self.shapes))].shape[0] for f, _ in self.factors]
        self.matrix = torch.empty((sum(self.ranks), sum(sizes)))
        row = 0
        for (f, weight), rank in zip(self.factors, self.ranks):  # (Σ rank, P), in place: one pass over them
            for block, k in zip(self.matrix[row:row + rank].split(sizes, 1), self.shapes):
                torch.mul(f[k].reshape(rank, -1), weight ** 0.5, out=block)
            row += rank
        return self

    def __exit__(self, *exc) -> None:
        self.matrix = None

    def __call__(self, v: TaskVector) -> TaskVector:
        flat = TaskVector({k: v[k] for k in self.shapes}).flatten().float()
        return TaskVector.unflatten(self.matrix.T @ (self.matrix @ flat), self.shapes)

    def gram(self) -> torch.Tensor:
        """MMᵀ (float64, K × K) for the stacked, weighted factors M, by blocks: a factor's own block is diagonal
        (its rows √h·v have orthonormal v: c·diag(h), from the row norms), so only the blocks between factors take
        matrix products (for two clients of rank 256 over 74,498 LoRA parameters, a third of the whole Gram's
        cost; for rank 1,920, seconds)."""
        bounds = [0, *itertools.accumulate(self.ranks)]
        gram = torch.zeros((bounds[-1], bounds[-1]), dtype=torch.float64)
        gram[range(bounds[-1]), range(bounds[-1])] = torch.linalg.vector_norm(self.matrix, dim=1).double() ** 2
        for i, j in itertools.combinations(range(len(self.ranks)), 2):
            block = (self.matrix[bounds[i]:bounds[i + 1]] @ self.matrix[bounds[j]:bounds[j + 1]].T).double()
            gram[bounds[i]:bounds[i + 1], bounds[j]:bounds[j + 1]] = block
            gram[bounds[j]:bounds[j + 1], bounds[i]:bounds[i + 1]] = block.T
        return gram

    def inverse(self, unit_gram: torch.Tensor | None = None) -> LowRankInverse:
        """(H + λI)⁻¹ for this operator, as a preconditioner (`conjugate_gradient`'s): exact, so CG stops
        after an iteration or two. `unit_gram`: the Gram of the same factors, in the same order, at unit weights,
        formed earlier (F²L² keeps it with the run), so that no block product is taken here."""
        if unit_gram is None:
            return LowRankInverse(self.matrix, self.shapes, self.gram())
        if tuple(unit_gram.shape) != (len(self.matrix),) * 2:
            raise ValueError(f"a Gram of shape {tuple(unit_gram.shape)} for {len(self.matrix)} factor rows")
        scale = torch.cat([torch.full((rank,), weight ** 0.5, dtype=torch.float64)
                           for (_, weight), rank in zip(self.factors, self.ranks)])
        return LowRankInverse(self.matrix, self.shapes, unit_gram.double() * scale[:, None] * scale[None, :])


class LowRankInverse:
    """(MᵀM + λI)⁻¹·r = (r − Mᵀ·(MMᵀ + λI)⁻¹·M·r)/λ (Woodbury) for the stacked factors M (K × P, K = Σ ranks) and
    their Gram MMᵀ (`LowRankGaussNewton.gram`), with a Cholesky factor of MMᵀ + λI per λ (K³/3 multiply-adds,
    a small share of an eigendecomposition's), so each λ costs one factorization and each product two passes
    over M. Used as a preconditioner it keeps CG exact whatever the rows' orthonormality error; `largest` is H's
    λ_max, MMᵀ's largest eigenvalue (computed when first asked: the relative damping needs it, the objective's
    does not)."""

    def __init__(self, matrix: torch.Tensor, shapes: dict, gram: torch.Tensor):
        self.matrix, self.shapes, self.gram = matrix, shapes, gram
        self._largest: float | None = None
        self._solver_at: tuple[float, Callable[[torch.Tensor], torch.Tensor]] | None = None  # the last λ's

    @property
    def largest(self) -> float:
        if self._largest is None:
            self._largest = float(torch.linalg.eigvalsh(self.gram)[-1]) if len(self.gram) else 0.0
        return self._largest

    def _solver(self, damping: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """c ↦ (MMᵀ + λI)⁻¹·c: by Cholesky; where float32 round-off in the Gram's blocks leaves MMᵀ + λI
        indefinite (λ below that round-off), by its eigendecomposition with the negative eigenvalues at 0. Kept
        for the last λ only (a CG solve asks for one λ throughout; a trust region's next solve for another)."""
        if self._solver_at is None or self._solver_at[0] != damping:
            shifted = self.gram + damping * torch.eye(len(self.gram), dtype=torch.float64)
            lower, info = torch.linalg.cholesky_ex(shifted)
            if int(info) == 0:
                solve = lambda c: torch.cholesky_solve(c[:, None], lower)[:, 0]  # noqa: E731
            else:
                values, vectors = torch.linalg.eigh(self.gram)
                scale = 1.0 / (values.clamp(min=0.0) + damping)
                solve = lambda c: vectors @ ((vectors.T @ c) * scale)  # noqa: E731
            self._solver_at = (damping, solve)
        return self._solver_at[1]

    def __call__(self, r: TaskVector, damping: float) -> TaskVector:
        if damping <= 0:
            raise ValueError("LowRankInverse needs damping > 0")
        flat = TaskVector({k: r[k] for k in self.shapes}).flatten().float()
        inner = self._solver(damping)((self.matrix @ flat).double())
        return TaskVector.unflatten((flat - self.matrix.T @ inner.float()) / damping, self.shapes)
