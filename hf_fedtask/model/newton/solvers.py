"""Linear solves with a symmetric positive semi-definite operator given as a function v ↦ A·v over
`TaskVector`s (`hf_fedtask.model.newton.operators`' Hessians, or a stack of curvature factors):
`conjugate_gradient` for (A + λI)·x = b, optionally preconditioned (`hf_fedtask.model.newton.lowrank`);
`CGIterate`, one iteration of it, so that a federated server can take it a round at a time (F²L²'s
`linear_solver: cg`); and `solve_within_radius`, a Levenberg-Marquardt trust region that raises λ until the
step fits a radius. Hand-written: torch has no CG over parameter dicts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_fedtask.core.taskvector import TaskVector

if TYPE_CHECKING:
    from hf_fedtask.model.newton.lowrank import LowRankInverse, SpectralPreconditioner


@dataclass
class SolveInfo:
    """How a conjugate-gradient solve ended: iterations and the relative residual ‖b − A·x‖ / ‖b‖."""

    iterations: int
    relative_residual: float


REFINE_SLACK = 10.0  # preconditioned CG: refine while the recomputed residual exceeds this × the tolerance


def conjugate_gradient(apply: Callable[[TaskVector], TaskVector], b: TaskVector, *, damping: float = 0.0,
                       iterations: int = 100, tolerance: float = 1e-6,
                       preconditioner: SpectralPreconditioner | LowRankInverse | None = None,
                       ) -> tuple[TaskVector, SolveInfo]:
    """x with (A + damping·I)·x = b for a symmetric positive semi-definite A given as `apply`
    (Hestenes-Stiefel CG, from x = 0; with `preconditioner`, preconditioned CG with its M⁻¹ at this damping),
    stopping when ‖r‖ ≤ tolerance·‖b‖; the residual reported is recomputed from x (one more product). A
    preconditioned solve whose recomputed residual is still above `REFINE_SLACK` × tolerance (float32 round-off
    in M⁻¹ at a large λ_max/λ makes the updated residual drift from the true one) solves again for the
    correction from the true residual (iterative refinement), within the same `iterations`, while that halves
    the residual."""
    def product(p: TaskVector) -> TaskVector:
        return apply(p) + p * damping if damping else apply(p)

    b_norm = b.norm()
    x = b.zeros_like()
    if b_norm == 0:
        return x, SolveInfo(0, 0.0)
    done, rhs, previous = 0, b, float("inf")
    while True:
        correction, steps = _cg(product, rhs, iterations - done, tolerance * b_norm, damping, preconditioner)
        x, done = x + correction, done + steps
        remaining = b - product(x)
        residual = remaining.norm() / b_norm
        if (preconditioner is None or residual <= REFINE_SLACK * tolerance or done >= iterations or steps == 0
                or residual > previous / 2):  # converged, out of iterations, or at float32's floor
            return x, SolveInfo(done, float(residual))
        rhs, previous = remaining, residual


@dataclass
class CGIterate:
    """Where (preconditioned) CG stands on A·x = b: the iterate x, the residual r = b − A·x (as updated), the
    direction p and rz = r·M⁻¹r. One step needs one product A·p, so a federated server can take it a round at
    a time (F²L²'s `linear_solver: cg`), the same iteration `conjugate_gradient` loops over."""

    x: TaskVector
    r: TaskVector
    p: TaskVector
    rz: float

    @staticmethod
    def start(x: TaskVector, r: TaskVector, precondition: Callable[[TaskVector], TaskVector]) -> CGIterate:
        z = precondition(r)
        return CGIterate(x, r, z, float(r.dot(z)))

    def step(self, ap: TaskVector, precondition: Callable[[TaskVector], TaskVector], stop: float,
             plain: bool = False) -> tuple[CGIterate, bool]:
        """(the next iterate, whether CG stops: ‖r‖ ≤ `stop`, or A is numerically singular along p) from
        ap = A·p. `plain`: no preconditioner, whose rz is ‖r‖² already (no norm to take)."""
        curvature = float(self.p.dot(ap))
        if curvature <= 0:  # numerically singular along p (damping 0): stop with what we have
            return self, True
        alpha = self.rz / curvature
        x, r = self.x + self.p * alpha, self.r - ap * alpha
        z = precondition(r)
        rz = float(r.dot(z))
        if (rz ** 0.5 if plain else float(r.norm())) <= stop:  # ‖r‖ ≤ tol·‖b‖
            return CGIterate(x, r, self.p, rz), True
        return CGIterate(x, r, z + self.p * (rz / self.rz), rz), False


def _cg(product: Callable[[TaskVector], TaskVector], b: TaskVector, iterations: int, stop: float, damping: float,
        preconditioner) -> tuple[TaskVector, int]:
    """(x, iterations) of (preconditioned) CG for product(x) = b from x = 0, until ‖r‖ ≤ `stop`."""
    def precondition(r: TaskVector) -> TaskVector:
        return r if preconditioner is None else preconditioner(r, damping)

    iterate = CGIterate.start(b.zeros_like(), b.clone(), precondition)
    done = 0
    for done in range(1, iterations + 1):
        iterate, stopped = iterate.step(product(iterate.p), precondition, stop, plain=preconditioner is None)
        if stopped:
            break
    return iterate.x, done


@dataclass
class TrustInfo:
    """How `solve_within_radius` ended: the damping it settled on, the solves it took (1: the first step
    fitted) and the last solve's `SolveInfo`."""

    damping: float
    solves: int
    solve: SolveInfo


def solve_within_radius(apply: Callable[[TaskVector], TaskVector], b: TaskVector, *, damping: float, radius: float,
                        iterations: int = 100, tolerance: float = 1e-6, max_solves: int = 12,
                        offset: TaskVector | None = None,
                        preconditioner: SpectralPreconditioner | LowRankInverse | None = None,
                        ) -> tuple[TaskVector, TrustInfo]:
    """x = (A + λ·I)⁻¹·b with about the smallest λ ≥ `damping` for which ‖x‖ ≤ `radius` (a Levenberg-Marquardt
    trust region; ‖x(λ)‖ falls monotonically with λ). The first solve uses `damping`; while the step is
    too long, λ grows along the secant of log ‖x‖ against log λ (slope clipped to [1/4, 1]; 1 at first,
    the flat directions' ‖x‖ ∝ 1/λ), aiming at 0.95·radius; once a step fits, log λ is bisected between
    the last λ too small and the first that fits. It stops at a step within [0.8, 1]·radius, or after
    `max_solves` with the fitting step of the smallest λ found (λ raised 100-fold if none fitted).
    `radius` ≤ 0: no region, one solve. With `offset` the region bounds ‖offset + x‖ instead (a step that
    starts from elsewhere, e.g. F²L²'s anchored form, solved from w₀ and measured from w*). `preconditioner`
    goes to every solve (`conjugate_gradient`)."""
    def solve(lam: float):
        x, info = conjugate_gradient(apply, b, damping=lam, iterations=iterations, tolerance=tolerance,
                                     preconditioner=preconditioner)
        return lam, x, info, (x if offset is None else offset + x).norm()

    low = solve(damping)  # (λ, x, info, ‖x‖), the largest λ known to give too long a step
    solves = 1
    if radius <= 0 or low[3] <= radius:
        return low[1], TrustInfo(damping, solves, low[2])
    previous, fits = None, None  # the try before `low`; the smallest λ known to fit
    while solves < max_solves:
        if fits is None:
            slope = 1.0
            if previous is not None:
                slope = -math.log(low[3] / previous[3]) / math.log(low[0] / previous[0])
                slope = min(max(slope, 0.25), 1.0)
            base = low[0] if low[0] > 0 else 1e-12 * b.norm() / radius
            lam = base * (low[3] / (0.95 * radius)) ** (1.0 / slope)
        else:
            lam = math.sqrt(low[0] * fits[0]) if low[0] > 0 else fits[0] / 10
        tried = solve(lam)
        solves += 1
        if tried[3] > radius:
            previous, low = low, tried
        else:
            fits = tried
            if tried[3] >= 0.8 * radius:
                break
    if fits is None:
        fits = solve(low[0] * 100.0)
        solves += 1
    return fits[1], TrustInfo(fits[0], solves, fits[2])
