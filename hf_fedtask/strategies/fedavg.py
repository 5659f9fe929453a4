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
from .base import SHARED, ClientJob, GlobalState, Strategy, head_name, register_strategy


@register_strategy
@dataclass
class FedAvg(Strategy):
    name = "fedavg"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"

    server_lr: float = 1.0

    def _proximal_mu(self) -> float:
        return 0.0

    def client_update(self, state: GlobalState, job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        shared = state.vectors[SHARED]
        heads, metrics = {}, {}
        for task in sorted(job.data):
            start = TaskVector({**shared, **state.vectors[head_name(task)]})
            trained, m = trainer.train(start, job.data[task], seed=job.seed_for(task), proximal_mu=self._proximal_mu())
            shared = trained.filter(lambda k: k in state.vectors[SHARED])
            heads[task] = trained.filter(lambda k: k not in state.vectors[SHARED])
            metrics[f"{task}/train_loss"] = m["train_loss"]
        vectors = {SHARED: shared - state.vectors[SHARED]}
        vectors.update({head_name(t): h - state.vectors[head_name(t)] for t, h in heads.items()})
        return ClientUpdate(
            client_id=job.client_id,
            round=job.round,
            vectors=vectors,
            num_samples={t: len(d) for t, d in job.data.items()},
            metrics=metrics,
        )

    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        vectors = dict(state.vectors)
        mean = weighted_average((u.vectors[SHARED] for u in updates), (u.total_samples for u in updates))
        vectors[SHARED] = state.vectors[SHARED] + self.server_lr * mean
        for task in sorted({t for u in updates for t in u.num_samples}):
            holders = [u for u in updates if task in u.num_samples]
            key = head_name(task)
            mean = weighted_average((u.vectors[key] for u in holders), (u.num_samples[task] for u in holders))
            vectors[key] = state.vectors[key] + self.server_lr * mean
        return GlobalState(round=state.round + 1, vectors=vectors, scalars=dict(state.scalars))


@register_strategy
@dataclass
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"

    proximal_mu: float = 0.01

    def _proximal_mu(self) -> float:
        return self.proximal_mu
