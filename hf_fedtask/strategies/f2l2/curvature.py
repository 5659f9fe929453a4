"""The curvature factors of F²L²'s Hessians: F with FᵀF ≈ H, H's top eigenpairs as rows √h·v
(`hf_fedtask.model.newton.curvature_factor`). With `curvature_rank` > 0 each client uploads the factor of its
data term's Hessian H_k at w₀ once (`client_curvature`), and the server keeps the factors with their Gram, from
which the removal's Hessian and linear_solver cg's preconditioner are inverted exactly (`factor_inverse`).
The server factors its own slice's H_s (`factor_server_hessian`): the removal's λ_max and preconditioner.
`CurvatureFactors` is the part of the `F2L2` strategy that keeps them (it uses `F2L2._task`)."""

from __future__ import annotations

import torch

from hf_fedtask.core.state import CURVATURE, CURVATURE_GRAM, SERVER_CURVATURE, curvature_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.strategies.base import GlobalState, task_point
from hf_fedtask.strategies.f2l2.protocol import CG, CG_START, GRADIENT_QUERY

FACTOR_JACOBIAN_BYTES = 2 << 30  # a client forms its Jacobian for its factor up to this (once, at the end of
# training; then each of the factor's Lanczos products is two matrix products instead of a pass over its data)
EIGEN_ITERATIONS = 30  # Lanczos products for λ_max(H_s): measured, 8-20 reach a relative change of 1e-4
SERVER_FACTOR_BYTES = 256 << 20  # the server's factor of H_s kept with the run: `server_curvature_rank` is
# lowered to fit (rank × P float32; 128 rows of the paper's MLP are 43 MB)


def client_curvature(host, model: TaskVector, point: TaskVector, data, rank: int, seed: int) -> TaskVector:
    """A client's curvature factor F (FᵀF ≈ its data term's Hessian at `point`, the top `rank` eigenpairs)
    over its prepared `data`, as its gradient round uploads it: through its Jacobian where that fits
    `FACTOR_JACOBIAN_BYTES`, else matrix-free."""
    from hf_fedtask.model.newton import curvature_factor, hessian

    with hessian(host, point, data, max_bytes=FACTOR_JACOBIAN_BYTES) as products:
        return curvature_factor(products, model, rank, seed=seed)


def factor_tail(factor: TaskVector) -> float:
    """The smallest eigenvalue a curvature factor keeps (its last row's squared norm; 0 where the client's
    Hessian has fewer eigenvalues than the rank, `curvature_factor` pads with zero rows): a bound on the
    curvature it leaves out in any direction."""
    return float(sum(t[-1].double().pow(2).sum() for t in factor.values()))


class CurvatureFactors:
    """Where the curvature factors come from in an `F2L2` run and how its state keeps them: which query
    carries the clients' (`factor_query`), the server's own (`factor_server_hessian`), their layout, Gram and
    bookkeeping scalars, and the operator and exact inverse built from them (`factor_inverse`)."""

    def factor_query(self, query: str) -> bool:
        """Whether the clients' curvature factors (`curvature_rank` > 0) come with this query's answer: the
        gradient round's, or with linear_solver cg the first round's, where they also precondition training (the
        model is linear in w, so H_k at w₀ is the same in every round)."""
        return bool(self.config.curvature_rank) and query == (CG_START if self.config.linear_solver == CG
                                                               else GRADIENT_QUERY)

    @staticmethod
    def _factor_template(model: TaskVector, rank: int) -> TaskVector:
        """The layout of a curvature factor of `rank` rows over `model`'s parameters."""
        return TaskVector({k: torch.zeros((rank, *v.shape), dtype=torch.float32) for k, v in model.items()})

    def factor_server_hessian(self, state: GlobalState, env) -> GlobalState:
        """The state with the server's factor F_s of H_s at w₀ (`SERVER_CURVATURE`, FᵀF ≈ H_s, the top
        `server_curvature_rank` eigenpairs, the rank lowered to fit `SERVER_FACTOR_BYTES`). It depends on w₀
        and D_s alone, so the server can form it before any removal is asked for, and every removal then
        reads λ_max from it and preconditions its solves with it (`SpectralPreconditioner`)."""
        rank = self.config.server_curvature_rank
        if not rank or SERVER_CURVATURE in state.vectors:
            return state
        from hf_fedtask.model.newton import curvature_factor, hessian

        task = self._task(state)
        point = task_point(state.vectors, task)
        rank = min(rank, SERVER_FACTOR_BYTES // (4 * sum(t.numel() for t in point.values())))
        if rank < 1:
            return state
        with hessian(env.host, point, self.server_split(env, task)[1], env.config.eval_batch_size) as products:
            factor = curvature_factor(products, point, rank, seed=env.config.seed)
        return GlobalState(state.round, {**state.vectors, SERVER_CURVATURE: factor},
                           {**state.scalars, "server_curvature_rank": rank})

    @staticmethod
    def factor_clients(scalars: dict) -> list[str]:
        """The clients whose factors the state holds, in the order of their kept Gram's rows (runs made before
        `factor_clients` was kept: the gradient round's clients)."""
        return scalars.get("factor_clients", list(scalars.get("gradient_samples", {})))

    def uploaded_factors(self, updates: list[ClientUpdate], query: str) -> dict[str, TaskVector]:
        """The clients' curvature factors this query's answers carry, by their state names, and their Gram at
        unit weights (`CURVATURE_GRAM`, rows in `factor_clients` order), formed here once so that neither training
        nor a removal takes the block products again (for two LoRA clients of rank 1,920, seconds of a removal's
        time); none: {}."""
        if not self.factor_query(query):
            return {}
        by_client = {str(u.client_id): u.vectors[CURVATURE] for u in updates}
        factors = {curvature_name(int(c)): by_client[c] for c in sorted(by_client)}
        return {**factors, CURVATURE_GRAM: self.factor_gram(list(factors.values()))}

    @staticmethod
    def factor_gram(factors: list[TaskVector]) -> TaskVector:
        """The Gram of these factors' stacked rows at unit weights (`LowRankGaussNewton.gram`, float32), as the
        state keeps it (`CURVATURE_GRAM`)."""
        from hf_fedtask.model.newton import LowRankGaussNewton

        with LowRankGaussNewton([(f, 1.0) for f in factors]) as stack:
            return TaskVector({"gram": stack.gram().float()})

    def factor_scalars(self, state: GlobalState, updates: list[ClientUpdate], query: str) -> dict:
        """The scalars that say which factors the state holds (`curvature_rank`, `factor_clients`, `factor_gram`):
        set by the query that carried them, kept after."""
        if not self.factor_query(query):
            return {"curvature_rank": state.scalars.get("curvature_rank", 0)}
        return {"curvature_rank": self.config.curvature_rank, "factor_gram": True,
                "factor_clients": sorted(str(u.client_id) for u in updates)}

    def factor_inverse(self, state: GlobalState, weights: dict[str, float]):
        """(the operator v ↦ Σ_c w_c·F_cᵀF_c·v over the factors of the clients in `weights`, as a context manager
        (`LowRankGaussNewton`), a function of it giving its `LowRankInverse` from the kept Gram where the run
        kept one)."""
        from hf_fedtask.model.newton import LowRankGaussNewton

        clients, rank = self.factor_clients(state.scalars), state.scalars["curvature_rank"]
        chosen = [c for c in clients if c in weights]
        operator = LowRankGaussNewton([(state.vectors[curvature_name(int(c))], weights[c]) for c in chosen])
        if CURVATURE_GRAM not in state.vectors:
            return operator, lambda stack: stack.inverse()
        rows = torch.cat([torch.arange(i * rank, (i + 1) * rank) for i, c in enumerate(clients) if c in weights])
        unit = state.vectors[CURVATURE_GRAM]["gram"][rows][:, rows]
        return operator, lambda stack: stack.inverse(unit)
