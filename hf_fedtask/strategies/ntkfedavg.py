"""NTKFedAvg and NTKFedProx (Muhamed, Mankikar and Smith, 2024, openreview.net/forum?id=K8jxsDF9xO,
Alg. 1 and App. A.4): FedAvg in which every client trains the first-order Taylor expansion of the model
(`hf_fedtask.model.linearize`) instead of the model itself.

Client k starts at the server state θ_s and trains f_lin(x; θ) = f(x; θ_lin) + J(x)·(θ − θ_lin),
with θ_lin = θ_s (`linearize_at="server"`, re-linearized every round; the default) or the
pretrained/initial θ_0 (`"pretrained"`). It sends τ_k = θ_k − θ_s; the server step, unlearning by
negation and the task-vector bookkeeping are FedAvg's. The server also keeps the point its current
state is linearized around (`linearized_at/...`), so the federated model is evaluated as the
linearized model at θ_s (and, labelled `<metric>_nonlinear`, as the ordinary model at θ_s).
"""

from __future__ import annotations

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.strategies.base import (
    Capabilities,
    ClientJob,
    GlobalState,
    Linearized,
    as_point,
    register_strategy,
    task_model,
)

# `NAME as NAME`: re-exported, defined here before hf_fedtask.strategies.configs
from hf_fedtask.strategies.configs import LINEARIZE_AT as LINEARIZE_AT
from hf_fedtask.strategies.configs import NTKFedAvgConfig, NTKFedProxConfig
from hf_fedtask.strategies.fedavg import FedAvg, FedProx


@register_strategy
class NTKFedAvg(FedAvg, Linearized):
    name = "ntkfedavg"
    paper = ("Muhamed, Mankikar and Smith, Fed Up with Complexity: Simplifying Many-Task Federated Learning "
             "with NTKFedAvg")
    config_class = NTKFedAvgConfig
    capabilities = Capabilities(federated_unlearning=True, task_vector_tracking=True, linearized=True,
                                exports=("adapters", "linearized"), client_dp=True)

    @property
    def linearization(self) -> str:
        return self.config.linearization

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        state.vectors.update(as_point(state.vectors))  # round 0: linearized at the initial θ_0
        return state

    def _train_options(self, downlink: dict[str, TaskVector], job: ClientJob, task: str) -> dict:
        if self.config.linearize_at == "server":
            point = task_model(downlink, task)
        else:
            point = TaskVector({**job.origin, **job.initial_heads[task]})
        return {**super()._train_options(downlink, job, task), "linearize_at": point,
                "linearization": self.config.linearization}

    def server_aggregate(self, state: GlobalState, updates) -> GlobalState:
        new = super().server_aggregate(state, updates)
        if self.config.linearize_at == "server":  # θ_{s,i+1} is evaluated in the expansion around θ_{s,i}
            new.vectors.update(as_point(state.vectors))
        return new

    def private_aggregate(self, state: GlobalState, updates) -> GlobalState:
        """FedAvg's step under client-level DP, re-linearized as `server_aggregate` is."""
        new = super().private_aggregate(state, updates)
        if self.config.linearize_at == "server":
            new.vectors.update(as_point(state.vectors))
        return new


@register_strategy
class NTKFedProx(NTKFedAvg, FedProx):
    """NTKFedAvg whose clients add FedProx's (μ/2)·‖θ − θ_s‖² (the paper uses μ = 1)."""

    name = "ntkfedprox"
    config_class = NTKFedProxConfig
