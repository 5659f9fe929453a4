"""Second-order pieces of F²L²'s removal step (Jin et al., 2023, arXiv:2306.02216) for a model linearized
around w₀, over `TaskVector`s of the trainable parameters by PEFT saved name:

    operators  the Gauss-Newton Hessian H of the training loss's data term, and its gradient
    solvers    (H + λI)·x = g by conjugate gradient: whole, one iteration at a time, or within a trust radius
    lanczos    λ_max(H) and H's top eigenpairs (a curvature factor F, FᵀF ≈ H)
    lowrank    Hessians, inverses and preconditioners built from curvature factors

Hand-written: torch has no CG over parameter dicts and the Hessian-free libraries around are unmaintained.
What these cost on the paper's settings: docs/results/f2l2.md.
"""

from hf_fedtask.model.newton.lanczos import EigenInfo, curvature_factor, largest_eigenvalue
from hf_fedtask.model.newton.lowrank import LowRankGaussNewton, LowRankInverse, SpectralPreconditioner
from hf_fedtask.model.newton.operators import (
    JACOBIAN_BYTES,
    GaussNewton,
    JacobianGaussNewton,
    data_gradient,
    gauss_newton_product,
    hessian,
    objective_minimizer,
)
from hf_fedtask.model.newton.solvers import (
    REFINE_SLACK,
    CGIterate,
    SolveInfo,
    TrustInfo,
    conjugate_gradient,
    solve_within_radius,
)

__all__ = ["JACOBIAN_BYTES", "REFINE_SLACK", "CGIterate", "EigenInfo", "GaussNewton", "JacobianGaussNewton",
           "LowRankGaussNewton", "LowRankInverse", "SolveInfo", "SpectralPreconditioner", "TrustInfo",
           "conjugate_gradient", "curvature_factor", "data_gradient", "gauss_newton_product", "hessian",
           "largest_eigenvalue", "objective_minimizer", "solve_within_radius"]
