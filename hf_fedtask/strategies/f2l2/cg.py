"""F²L²'s `linear_solver: cg`: training by federated conjugate gradient instead of FedAvg. The objective is
quadratic (squared error on a model linear in w), so its minimizer solves one linear system,
(Σ_k (n_k/n)·H_k + (l2 + λ_r)·I)·w = b. The first training round asks each client for its data gradient at w⁰
(the residual r₀); each later one sends the direction p and asks for H_k·p, an upload the size of the model,
and the server takes the CG step, preconditioned by the clients' curvature factors or the server's
(`curvature.py`). Training so ends at the objective's optimum, the point the certificate assumes.
`FederatedCG` is the part of the `F2L2` strategy that runs it (it uses `F2L2`'s model and regularizer)."""

from __future__ import annotations

from hf_fedtask.core.state import GRADIENT, SERVER_CURVATURE, curvature_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ProtocolError
from hf_fedtask.strategies.base import AggregatedState, GlobalState, task_point, task_vectors
from hf_fedtask.strategies.f2l2.protocol import CG_DIRECTION, CG_RESIDUAL, CG_START, GRADIENTS, LINEAR, PRODUCT

CG_TOLERANCE = 1e-6  # stop (a zero direction, no pass over the data) at ‖r‖ ≤ this × ‖r₀‖, float32's floor
# what linear_solver cg does not use (pretraining sets its own; it keeps batch_size)
LOCAL_TRAINING = ("local_epochs", "local_steps", "learning_rate", "lr_round_schedule", "optimizer", "lr_scheduler",
                  "warmup_steps", "weight_decay")


class FederatedCG:
    """linear_solver cg's server side in an `F2L2` run: the preconditioner, the check that every round hears
    from the first round's clients, and one CG iteration per round."""

    def training_preconditioner(self, state: GlobalState, updates: list[ClientUpdate], lam: float):
        """linear_solver cg's M⁻¹ at λ = l2 + λ_r: with the clients' factors (`curvature_rank` > 0), the Woodbury
        inverse of Σ_k (n_k/n)·F_kᵀF_k + λI (`LowRankInverse`), the system's own Hessian (complete factors: exact
        up to float32, so CG stops in a few rounds: 2 on a probe, 4-9 on LoRA); else the server's factor of H_s
        (`SpectralPreconditioner`), which stands in for it; with λ = 0, none (M⁻¹ divides by λ beyond the factors'
        span)."""
        from hf_fedtask.model.newton import SpectralPreconditioner

        clients = state.scalars.get("factor_clients", [])
        if lam <= 0 or (not clients and SERVER_CURVATURE not in state.vectors):
            return lambda r: r
        if not clients:
            server = SpectralPreconditioner(state.vectors[SERVER_CURVATURE])
            return lambda r: server(r, lam)
        n = {str(u.client_id): u.total_samples for u in updates}
        total = sum(n[c] for c in clients)
        factors = [(state.vectors[curvature_name(int(c))], n[c] / total) for c in clients]
        cached = self._training_inverse
        if cached is None or len(cached[0]) != len(factors) or not all(
                f is g and a == b for (f, a), (g, b) in zip(cached[0], factors)):  # the same factors every round
            operator, inverse = self.factor_inverse(state, {c: n[c] / total for c in clients})
            with operator as stack:  # stacked once a run (and after a resume)
                self._training_inverse = cached = (factors, inverse(stack))
        return lambda r: cached[1](r, lam)

    @staticmethod
    def check_cg_clients(state: GlobalState, updates: list[ClientUpdate]) -> list[int]:
        """The clients of linear_solver cg's first round (`cg_clients`, kept in the state's scalars, so they survive
        a resume), refusing a later round whose replies are not exactly theirs: each CG product must be
        Σ_k (n_k/n)·H_k·p over the same clients as r₀, or the iterates stop being conjugate gradient of one
        system (and the clients' factors, with `curvature_rank` > 0, would miss a client's sample count).
        Raised in `server_aggregate`: the run loop neither checkpoints nor records the round. A checkpoint made before
        `cg_clients` was kept: the factors' clients where it has them, else this round's."""
        replied = sorted(u.client_id for u in updates)
        kept = state.scalars.get("cg_clients", state.scalars.get("factor_clients"))
        if kept is None:
            return replied
        expected = sorted(int(c) for c in kept)
        missing, extra = sorted(set(expected) - set(replied)), sorted(set(replied) - set(expected))
        if not missing and not extra:
            return expected

        def named(ids: list[int]) -> str:
            return f"client{'s' * (len(ids) > 1)} {', '.join(map(str, ids))}"

        faults = ([f"{named(missing)} did not reply"] if missing else []) + (
            [f"{named(extra)} replied but took no part in the first round"] if extra else [])
        raise ProtocolError(f"f2l2 linear_solver cg, round {state.round + 1}: {' and '.join(faults)} (clients of the "
                            f"first round: {', '.join(map(str, expected))}); conjugate gradient needs every "
                            f"product over the same clients; round {state.round + 1} is not checkpointed: rerun "
                            "with --resume once every client of the first round replies")

    def conjugate_gradient_step(self, state: GlobalState, updates: list[ClientUpdate],
                                last_training: bool) -> AggregatedState:
        """linear_solver cg's server side: one iteration of preconditioned CG on ∇F(w) = 0 (`CGIterate`, the
        iteration `conjugate_gradient` loops over; here each product A·p = Σ_k (n_k/n)·H_k·p + (l2 + λ_r)·p is a
        round). The first round's uploads are the clients' data gradients at w⁰, which give r₀ = −∇F(w⁰); each
        later round's are H_k·p. The diagnostics log ‖r‖/‖r₀‖ each round; at `CG_TOLERANCE` the direction
        becomes zero and the model stays."""
        from hf_fedtask.model.newton import CGIterate

        first = "cg_iterations" not in state.scalars
        clients = sorted(u.client_id for u in updates) if first else self.check_cg_clients(state, updates)
        task, n = self._task(state), sum(u.total_samples for u in updates)
        w, w0 = self._model(state), task_point(state.vectors, task)
        lam = self.config.l2 + self.ridge_lambda(state)
        factors = self.uploaded_factors(updates, CG_START) if first else {}
        scalars = {**state.scalars, **(self.factor_scalars(state, updates, CG_START) if first else {}),
                   "cg_clients": clients}
        precondition = self.training_preconditioner(GlobalState(state.round, {**state.vectors, **factors}, scalars),
                                                    updates, lam)

        def mean(name: str) -> TaskVector:  # Σ_k (n_k/n)·upload_k
            return sum((u.vectors[name] * (u.total_samples / n) for u in updates), w.zeros_like())

        if first:  # r₀ = −∇F(w⁰) from the clients' data gradients
            r = (mean(GRADIENT) + self.regularizer_gradient(state, w, w0)) * -1.0
            iterate, stopped = CGIterate.start(w, r, precondition), r.norm() == 0
            scalars.update(cg_iterations=0, cg_initial=float(r.norm()))
        else:
            iterate = CGIterate(w, state.vectors[CG_RESIDUAL], state.vectors[CG_DIRECTION], scalars["cg_rz"])
            stopped = iterate.p.norm() == 0
            if not stopped:
                iterate, stopped = iterate.step(mean(PRODUCT) + iterate.p * lam, precondition,
                                                CG_TOLERANCE * scalars["cg_initial"])
                scalars["cg_iterations"] += 1
        relative = float(iterate.r.norm()) / scalars["cg_initial"] if scalars["cg_initial"] > 0 else 0.0
        scalars.update(cg_rz=iterate.rz, cg_relative_residual=relative, phase=GRADIENTS if last_training else LINEAR)
        vectors = {k: v for k, v in {**state.vectors, **factors}.items() if k not in (CG_DIRECTION, CG_RESIDUAL)}
        if not last_training:  # the gradient round needs neither; a zero direction: converged, no more passes
            vectors.update({CG_DIRECTION: iterate.p.zeros_like() if stopped else iterate.p, CG_RESIDUAL: iterate.r})
        vectors.update(task_vectors(iterate.x, state.vectors, task))
        return AggregatedState(state.round + 1, vectors, scalars,
                               diagnostics={"cg_iterations": scalars["cg_iterations"],
                                            "cg_relative_residual": relative})
