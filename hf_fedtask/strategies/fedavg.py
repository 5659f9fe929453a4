"""FedAvg (McMahan et al., 2017) and FedProx (Li et al., 2020) over PEFT task vectors.

Client: for each task it holds (in name order), start from the server's shared modules (as left
by the previous task) and the task's head, train locally, and send the change of the shared
modules and of each head. Server: the shared modules move by α times the sample-weighted mean of
all clients' changes; each head by α times the mean over the clients that hold its task.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..client import LocalTrainer
from ..merge import weighted_average
from ..taskvector import TaskVector
from ..update import ClientUpdate
from .base import (
    SHARED,
    ClientJob,
    GlobalState,
    Strategy,
    average_heads,
    head_name,
    register_strategy,
)


@register_strategy
@dataclass
class FedAvg(Strategy):
    name = "fedavg"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"

    server_lr: float = 1.0

    def _proximal_mu(self) -> float:
        return 0.0

    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        shared, heads, metrics = train_tasks_in_turn(downlink, job, trainer, proximal_mu=self._proximal_mu())
        vectors = {SHARED: shared - downlink[SHARED]}
        vectors.update({head_name(t): h - downlink[head_name(t)] for t, h in heads.items()})
        return ClientUpdate(job.client_id, job.round, vectors, job.num_samples(), metrics)

    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        vectors = dict(state.vectors)
        mean = weighted_average((u.vectors[SHARED] for u in updates), (u.total_samples for u in updates))
        vectors[SHARED] = state.vectors[SHARED] + self.server_lr * mean
        vectors.update(average_heads(state, updates, self.server_lr))
        return GlobalState(round=state.round + 1, vectors=vectors, scalars=dict(state.scalars))


def train_tasks_in_turn(downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer,
                        proximal_mu: float = 0.0) -> tuple[TaskVector, dict[str, TaskVector], dict]:
    """One model for all of a client's tasks: train each task (in name order) starting from the
    shared modules the previous task left and the task's own head. Returns the final shared modules,
    each task's trained head, and the train losses."""
    shared = downlink[SHARED]
    heads, metrics = {}, {}
    for task in job.tasks:
        start = TaskVector({**shared, **downlink[head_name(task)]})
        trained, m = trainer.train(start, job.data[task], seed=job.seed_for(task), proximal_mu=proximal_mu)
        shared = trained.filter(lambda k: k in downlink[SHARED])
        heads[task] = trained.filter(lambda k: k not in downlink[SHARED])
        metrics[f"{task}/train_loss"] = m["train_loss"]
    return shared, heads, metrics


@register_strategy
@dataclass
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"

    proximal_mu: float = 0.01

    def _proximal_mu(self) -> float:
        return self.proximal_mu
