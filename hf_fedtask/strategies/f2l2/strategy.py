"""F²L², Forgettable Federated Linear Learning (Jin, Chen, Zhang and Li, 2023, arXiv:2306.02216): federated
training of a model linearized at w₀, then certified removal of a client by one Newton step computed on the
server alone.

    round 1          the server pretrains w₀ on its own slice D_s of the training data (never sent) and keeps
                     it as the linearization point; with `ridge`, it sets λ_r from λ_max(H_s) at w₀
    rounds 1..R−1    FedAvg of the model linearized at w₀, trained on the squared error against one-hot
                     targets plus (λ/2)·‖w‖² (`l2`) and (λ_r/2)·‖w − w₀‖²; or, with `linear_solver: cg`,
                     federated conjugate gradient on the same objective (`cg.py`)
    round R          a query: each client sends the gradient of its data term at the final model and n_k;
                     with `curvature_rank` > 0 also its curvature factor (`curvature.py`)
    removal          `remove_client`: w₋ = w* − (H + λI)⁻¹·g₋ (`removal.py`)

One task per run (the removal acts on the shared model and that task's head). This module holds the phases
and the messages; the full description and the measurements behind the defaults: docs/results/f2l2.md."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from hf_fedtask.client.objectives import AnchoredRidge, OneHotMSE
from hf_fedtask.core.state import (
    CURVATURE,
    CURVATURE_GRAM,
    GRADIENT,
    POINT,
    SERVER_CURVATURE,
    curvature_name,
    gradient_name,
    point_name,
)
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError, ProtocolError
from hf_fedtask.strategies.base import (
    QUERY,
    SHARED,
    TRAIN,
    Capabilities,
    ClientJob,
    GlobalState,
    Linearized,
    Strategy,
    as_point,
    average_heads,
    fedavg_shared,
    register_strategy,
    task_model,
    task_point,
    task_vectors,
)
from hf_fedtask.strategies.configs import F2L2Config
from hf_fedtask.strategies.f2l2.cg import LOCAL_TRAINING, FederatedCG
from hf_fedtask.strategies.f2l2.curvature import EIGEN_ITERATIONS, CurvatureFactors, client_curvature
from hf_fedtask.strategies.f2l2.protocol import (
    CG,
    CG_DIRECTION,
    CG_PRODUCT,
    CG_RESIDUAL,
    CG_START,
    DONE,
    GRADIENT_QUERY,
    GRADIENTS,
    LINEAR,
    PRETRAIN,
    PRODUCT,
    RIDGE,
)
from hf_fedtask.strategies.f2l2.removal import CertifiedRemoval
from hf_fedtask.strategies.fedavg import delta_update


@register_strategy
class F2L2(Strategy, Linearized, CertifiedRemoval, CurvatureFactors, FederatedCG):
    name = "f2l2"
    paper = ("Jin, Chen, Zhang and Li, Forgettable Federated Linear Learning with Certified Data Removal, 2023 "
             "(arXiv:2306.02216)")
    config_class = F2L2Config
    capabilities = Capabilities(linearized=True, client_removal=True, exports=("adapters", "linearized"),
                                personalization=False, classifier_only=(
                                    "its certified removal takes Newton steps on the Hessian of a linearized "
                                    "classifier's cross-entropy over its class outputs, the convex loss its "
                                    "guarantee is stated for; a causal LM's next-token loss is not that loss"))

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self.total_rounds: int | None = None
        self._training_inverse = None  # linear_solver cg: (the clients' factors, their LowRankInverse), kept

    @property
    def server_fraction(self) -> float:
        return self.config.server_fraction

    def check_run(self, config) -> None:
        """Refuses what F²L² cannot do, and takes the run's length: its last round is the gradient query."""
        if config.participation < 1:
            raise ConfigError(f"strategy 'f2l2' needs every client in every round (participation 1, got "
                              f"{config.participation}): the removal needs each client's last-round gradient")
        if config.rounds < 2:
            raise ConfigError(f"strategy 'f2l2' needs rounds >= 2 (training rounds, then the gradient round), "
                              f"got {config.rounds}")
        tasks = config.tasks or []
        if config.suite or len(tasks) != 1:
            raise ConfigError("strategy 'f2l2' trains one task per run: give `tasks` with one task and no suite")
        if self.config.linear_solver == CG:
            defaults = {f.name: f.default for f in dataclasses.fields(config)}  # the run config's own defaults
            given = [name for name in LOCAL_TRAINING if getattr(config, name) != defaults[name]]
            if given:
                raise ConfigError(f"f2l2: linear_solver 'cg' trains by conjugate-gradient rounds, not local optimizer "
                                  f"steps, so {given[0]} ({getattr(config, given[0])!r}) would not apply; leave "
                                  f"{', '.join(given)} at their defaults or use linear_solver 'fedavg'")
        self.total_rounds = config.rounds

    # -- state ---------------------------------------------------------------------------------
    def phase(self, state: GlobalState) -> str:
        return state.scalars.get("phase", PRETRAIN)

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        state.scalars["phase"] = PRETRAIN
        return state

    def state_template(self, initial: GlobalState, scalars: dict) -> GlobalState:
        phase = scalars.get("phase", PRETRAIN)
        if phase == PRETRAIN:
            return initial
        vectors = {**initial.vectors, **as_point(initial.vectors)}
        if scalars.get("server_curvature_rank"):  # formed as the gradient round begins
            vectors[SERVER_CURVATURE] = self._factor_template(self._model(initial), scalars["server_curvature_rank"])
        model = self._model(initial)
        factors, gradients = {}, {}
        if scalars.get("curvature_rank"):  # the clients' factors: from the gradient round, or cg's first round
            factor = self._factor_template(model, scalars["curvature_rank"])
            clients = self.factor_clients(scalars)
            factors = {curvature_name(int(c)): factor for c in clients}
            if scalars.get("factor_gram"):  # their Gram, kept since (runs before it have none)
                size = scalars["curvature_rank"] * len(clients)
                factors[CURVATURE_GRAM] = TaskVector({"gram": torch.zeros((size, size), dtype=torch.float32)})
        if phase == DONE:
            gradients = {gradient_name(int(c)): model for c in scalars.get("gradient_samples", {})}
        # in the order the rounds add them (the order flattening follows): cg's factors come first, then its
        # direction and residual (gone after the last training round), the gradient round's last
        later = {**gradients, **factors}
        if self.config.linear_solver == CG:
            vectors.update(factors)
            later = gradients
        if phase == LINEAR and "cg_iterations" in scalars:  # linear_solver cg's direction and residual
            vectors.update({CG_DIRECTION: model, CG_RESIDUAL: model})
        return GlobalState(initial.round, {**vectors, **later}, dict(scalars))

    @staticmethod
    def _task(state: GlobalState) -> str:
        """The run's one task."""
        return state.tasks[0]

    def _model(self, state: GlobalState) -> TaskVector:
        """w: the shared modules and the task's head as one vector (saved names)."""
        return task_model(state.vectors, self._task(state))

    def linearization_point(self, state: GlobalState, task: str) -> TaskVector | None:
        """w₀, once the server has pretrained it (round 1); None before."""
        if self.phase(state) == PRETRAIN:
            return None
        return super().linearization_point(state, task)

    def server_split(self, env, task: str):
        """(the part of D_s the server pretrains w₀ on, the part its Hessian H_s is taken on): with
        `hessian_holdout` h > 0, a seeded share h of D_s is kept out of pretraining for H_s; with 0, D_s
        for both."""
        data = env.server_data(task)
        held = round(self.config.hessian_holdout * len(data))
        if held == 0 or held == len(data):
            return data, data
        order = np.random.default_rng(env.config.seed).permutation(len(data))
        return data.select(sorted(order[held:])), data.select(sorted(order[:held]))

    @staticmethod
    def ridge_lambda(state: GlobalState) -> float:
        """λ_r of the run's training objective (0 without a ridge)."""
        return float(state.scalars.get("ridge_lambda", 0.0))

    def regularizer_gradient(self, state: GlobalState, w: TaskVector, w0: TaskVector) -> TaskVector:
        """r(w) = l2·w + λ_r·(w − w₀), the gradient of the training objective's regularizer at w."""
        ridge = self.ridge_lambda(state)
        return w * self.config.l2 + (w - w0) * ridge if ridge else w * self.config.l2

    # -- the server's own work -----------------------------------------------------------------
    def server_step(self, state: GlobalState, env) -> GlobalState:
        """Round 1: pretrain w₀ on D_s and keep it as the linearization point; with a ridge, set
        λ_r = ρ·λ_max(H_s) at w₀ (Lanczos on the server's slice). The gradient round: factor H_s
        (`server_curvature_rank`) while the clients compute their gradients (with linear_solver cg, right after
        pretraining: it preconditions the training rounds' CG)."""
        if self.phase(state) == GRADIENTS:
            return self.factor_server_hessian(state, env)
        if self.phase(state) != PRETRAIN:
            return state
        from hf_fedtask.client.trainer import LocalTrainer

        task = self._task(state)
        w0 = self._model(state)
        c = self.config
        if c.pretrain_epochs > 0:
            args = dataclasses.replace(env.trainer.args, local_epochs=c.pretrain_epochs, local_steps=-1,
                                       learning_rate=c.pretrain_lr, optimizer="adamw_torch", lr_scheduler="cosine",
                                       warmup_steps=0, weight_decay=0.0)
            w0, _ = LocalTrainer(env.host, args).train(w0, self.server_split(env, task)[0], seed=env.config.seed)
        pretrained = task_vectors(w0, state.vectors, task)
        vectors = as_point(pretrained)
        if c.start == "pretrained":  # w⁰ = w₀; otherwise training starts from the initialization
            vectors.update(pretrained)
        scalars = {**state.scalars, "phase": LINEAR}
        if c.ridge > 0:
            from hf_fedtask.model.newton import hessian, largest_eigenvalue

            with hessian(env.host, w0, self.server_split(env, task)[1], env.config.eval_batch_size) as products:
                lambda_max, _ = largest_eigenvalue(products, w0, iterations=EIGEN_ITERATIONS, seed=env.config.seed)
            scalars.update(ridge_lambda=c.ridge * lambda_max, ridge_lambda_max=lambda_max)
        state = GlobalState(state.round, {**state.vectors, **vectors}, scalars)
        return self.factor_server_hessian(state, env) if c.linear_solver == CG else state  # CG's preconditioner

    # -- communication -------------------------------------------------------------------------
    def message_kind(self, state: GlobalState) -> str:
        phase = self.phase(state)
        if phase == DONE:
            raise ConfigError("f2l2: the run ended with its gradient round; more rounds would make the clients' "
                              "gradients stale (start a new run)")
        return QUERY if phase == GRADIENTS or self.config.linear_solver == CG else TRAIN

    def query_name(self, state: GlobalState) -> str:
        if self.phase(state) == GRADIENTS:
            return GRADIENT_QUERY
        if self.config.linear_solver == CG:
            return CG_PRODUCT if "cg_iterations" in state.scalars else CG_START
        return ""

    def downlink(self, state, client_id, tasks) -> dict[str, TaskVector]:
        """w, the linearization point w₀ and, with a ridge, λ_r (clients cannot rebuild either: D_s is
        the server's)."""
        model = super().downlink(state, client_id, tasks)
        extra = {RIDGE: TaskVector({"lambda": torch.tensor([self.ridge_lambda(state)])})} if self.config.ridge else {}
        if CG_DIRECTION in state.vectors and self.phase(state) == LINEAR:  # linear_solver cg: the direction p
            extra[CG_DIRECTION] = state.vectors[CG_DIRECTION]
        return {**model, **{point_name(k): state.vectors[point_name(k)] for k in model}, **extra}

    def update_templates(self, state, client_id, tasks) -> dict[str, TaskVector]:
        query = self.query_name(state)
        if query == CG_PRODUCT:
            return {PRODUCT: self._model(state)}
        if query in (GRADIENT_QUERY, CG_START):
            model = self._model(state)
            if not self.factor_query(query):
                return {GRADIENT: model}
            return {GRADIENT: model, CURVATURE: self._factor_template(model, self.config.curvature_rank)}
        return super().downlink(state, client_id, tasks)

    # -- client --------------------------------------------------------------------------------
    def client_update(self, downlink, job: ClientJob, trainer) -> ClientUpdate:
        ridge = float(downlink[RIDGE]["lambda"][0]) if RIDGE in downlink else 0.0

        def options(task: str) -> dict:
            point = task_point(downlink, task)
            objectives = [OneHotMSE(l2=self.config.l2)] + ([AnchoredRidge(ridge, point)] if ridge else [])
            return {"linearize_at": point, "objectives": objectives}

        model = {k: v for k, v in downlink.items() if not k.startswith(POINT) and k != RIDGE}
        return delta_update(model, job, trainer, options=options)

    def client_query(self, downlink, job: ClientJob, trainer) -> ClientUpdate:
        if job.query not in (GRADIENT_QUERY, CG_START, CG_PRODUCT):
            raise ProtocolError(f"f2l2: unknown query {job.query!r}")
        from hf_fedtask.model.newton import data_gradient, gauss_newton_product

        (task,) = job.tasks
        model, point, data = task_model(downlink, task), task_point(downlink, task), job.data[task]
        if job.query == CG_PRODUCT:  # H_k·p; a zero direction (CG has converged) needs no pass over the data
            direction = downlink[CG_DIRECTION]
            product = (direction.zeros_like() if direction.norm() == 0
                       else gauss_newton_product(trainer.host, point, direction, data))
            return ClientUpdate(job.client_id, job.round, {PRODUCT: product}, job.num_samples(), {})
        gradient, loss = data_gradient(trainer.host, model, point, data)
        vectors = {GRADIENT: gradient}
        if self.factor_query(job.query):  # the top eigenpairs of this client's H_k, for the removal's H₋
            vectors[CURVATURE] = client_curvature(trainer.host, model, point, data, self.config.curvature_rank,
                                                  seed=job.client_id)
        return ClientUpdate(job.client_id, job.round, vectors, job.num_samples(), {"data_loss": loss})

    # -- server --------------------------------------------------------------------------------
    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        if self.phase(state) == GRADIENTS:
            vectors = {gradient_name(u.client_id): u.vectors[GRADIENT] for u in updates}
            samples = {str(u.client_id): u.total_samples for u in updates}
            return state.next({**vectors, **self.uploaded_factors(updates, GRADIENT_QUERY)}, phase=DONE,
                              gradient_samples=samples, **self.factor_scalars(state, updates, GRADIENT_QUERY))
        last_training = self.total_rounds is not None and state.round + 2 >= self.total_rounds
        if self.config.linear_solver == CG:
            return self.conjugate_gradient_step(state, updates, last_training)
        vectors = {SHARED: fedavg_shared(state, updates), **average_heads(state, updates)}
        return state.next(vectors, phase=GRADIENTS if last_training else LINEAR)
