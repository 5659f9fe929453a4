"""FedAvg (McMahan et al., 2017) and FedProx (Li et al., 2020) over PEFT task vectors.

Client: for each task it holds (in name order), start from the server's shared modules (as left
by the previous task) and the task's head, train locally, and send the change of the shared
modules and of each head. Server: the shared modules move by α times the sample-weighted mean of
all clients' changes; each head by α times the mean over the clients that hold its task.

Federated task unlearning (NTKFedAvg's Alg. 1, lines 8–9) is part of the server step: with
`forget_tasks`, the updates of clients holding a forgotten task are negated before aggregation.
With `track_task_vectors`, the server also keeps each task's accumulated share of the shared
modules' movement (`task_vector/<task>`), the task vector a one-shot negation subtracts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_fedtask.client.trainer import LocalTrainer
from hf_fedtask.merge import weighted_average
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.strategies.base import (
    SHARED,
    ClientJob,
    GlobalState,
    Strategy,
    average_heads,
    head_name,
    register_strategy,
)

if TYPE_CHECKING:
    from hf_fedtask.data.task import Task
    from hf_fedtask.model.host import PeftHost

TASK_VECTOR = "task_vector/"


def task_vector_name(task: str) -> str:
    """Name of the vector holding `task`'s accumulated contribution in a FedAvg-family state."""
    return f"{TASK_VECTOR}{task}"


@register_strategy
@dataclass
class FedAvg(Strategy):
    name = "fedavg"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"

    server_lr: float = 1.0
    forget_tasks: list[str] | None = None
    track_task_vectors: bool = False

    def _train_options(self, downlink: dict[str, TaskVector], job: ClientJob, task: str) -> dict:
        """Extra `LocalTrainer.train` arguments for `task` (the linearization point, for NTKFedAvg)."""
        return {}

    def init_state(self, host: PeftHost, tasks: list[Task], seed: int, allocation: dict[int, list[str]]) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        if self.track_task_vectors:
            state.vectors.update({task_vector_name(t.name): state.vectors[SHARED].zeros_like() for t in tasks})
        return state

    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        shared, heads, metrics = train_tasks_in_turn(downlink, job, trainer,
                                                     options=lambda task: self._train_options(downlink, job, task))
        vectors = {SHARED: shared - downlink[SHARED]}
        vectors.update({head_name(t): h - downlink[head_name(t)] for t, h in heads.items()})
        return ClientUpdate(job.client_id, job.round, vectors, job.num_samples(), metrics)

    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        updates = negate_forgotten(updates, self.forget_tasks or ())
        vectors = dict(state.vectors)
        mean = weighted_average((u.vectors[SHARED] for u in updates), (u.total_samples for u in updates))
        vectors[SHARED] = state.vectors[SHARED] + self.server_lr * mean
        vectors.update(average_heads(state, updates, self.server_lr))
        if self.track_task_vectors:
            vectors.update(accumulate_task_vectors(state, updates, self.server_lr))
        return GlobalState(round=state.round + 1, vectors=vectors, scalars=dict(state.scalars))


def negate_forgotten(updates: list[ClientUpdate], forget: Iterable[str]) -> list[ClientUpdate]:
    """Unlearning by negation: every vector of a client holding a task in `forget` flips sign, so
    aggregation moves the model away from what that client's training would add."""
    forget = set(forget)
    return [dataclasses.replace(u, vectors={k: -v for k, v in u.vectors.items()}) if forget & set(u.num_samples) else u
            for u in updates]


def accumulate_task_vectors(state: GlobalState, updates: list[ClientUpdate], server_lr: float) -> dict[str, TaskVector]:
    """Each task's share of this round's shared-module step, added to its running total: a client's
    (sample-weighted) change is split over its tasks by their sample counts, so the task vectors sum
    to the movement of the shared modules since round 0."""
    total = sum(u.total_samples for u in updates)
    out = {}
    for task in sorted({t for u in updates for t in u.num_samples}):
        key = task_vector_name(task)
        step = out.get(key, state.vectors[key])
        for u in updates:
            if task in u.num_samples:
                step = step + u.vectors[SHARED] * (server_lr * u.num_samples[task] / total)
        out[key] = step
    return out


def train_tasks_in_turn(downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer,
                        options: Callable[[str], dict] = lambda task: {}) -> tuple[TaskVector, dict[str, TaskVector], dict]:
    """One model for all of a client's tasks: train each task (in name order) starting from the
    shared modules the previous task left and the task's own head (`options(task)`: extra
    `trainer.train` arguments). Returns the final shared modules, each task's trained head, and the
    train losses."""
    shared = downlink[SHARED]
    heads, metrics = {}, {}
    for task in job.tasks:
        start = TaskVector({**shared, **downlink[head_name(task)]})
        trained, m = trainer.train(start, job.data[task], seed=job.seed_for(task), **options(task))
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

    def _train_options(self, downlink: dict[str, TaskVector], job: ClientJob, task: str) -> dict:
        return {**super()._train_options(downlink, job, task), "proximal_mu": self.proximal_mu}
