"""FedAvg (McMahan et al., 2017) and FedProx (Li et al., 2020) over PEFT task vectors.

Client: for each task it holds (in name order), start from the server's shared modules (as left
by the previous task) and the task's head, train locally, and send the change of the shared
modules and of each head. Server: the shared modules move by α times the sample-weighted mean of
all clients' changes; each head by α times the mean over the clients that hold its task.

Federated unlearning (NTKFedAvg's Alg. 1, lines 8–9) is part of the server step: the updates of
clients holding a task in `forget_tasks`, or listed in `forget_clients`, are negated before
aggregation. With `track_task_vectors`, the server also keeps each task's accumulated share of the
shared modules' movement (`task_vector/<task>`), the task vector a one-shot negation subtracts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_fedtask.client.objectives import ProximalTerm
from hf_fedtask.core.fields import option
from hf_fedtask.core.state import tracked_task_vector_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.strategies.base import (
    SHARED,
    Capabilities,
    ClientJob,
    GlobalState,
    Strategy,
    StrategyConfig,
    average_heads,
    fedavg_shared,
    head_name,
    register_strategy,
    updates_by_task,
)

if TYPE_CHECKING:
    from hf_fedtask.client.trainer import LocalTrainer


@dataclass
class FedAvgConfig(StrategyConfig):
    server_lr: float = option(1.0, "server step size α: the state moves by α times the mean update")
    forget_tasks: list[str] | None = option(None, "unlearning: negate the updates of the clients holding these tasks")
    forget_clients: list[int] | None = option(None, "unlearning: negate the updates of these clients", minimum=0)
    track_task_vectors: bool = option(False, "keep each task's accumulated vector (for one-shot negation)")


@register_strategy
class FedAvg(Strategy):
    name = "fedavg"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
    config_class = FedAvgConfig
    capabilities = Capabilities(federated_unlearning=True, task_vector_tracking=True)

    def _train_options(self, downlink: dict[str, TaskVector], job: ClientJob, task: str) -> dict:
        """Extra `LocalTrainer.train` arguments for `task` (an objective, a linearization point)."""
        return {}

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        if self.config.track_task_vectors:
            state.vectors.update({tracked_task_vector_name(t.name): state.vectors[SHARED].zeros_like() for t in tasks})
        return state

    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        return delta_update(downlink, job, trainer, options=lambda task: self._train_options(downlink, job, task))

    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        c = self.config
        updates = negate_forgotten(updates, c.forget_tasks or (), c.forget_clients or ())
        vectors = {SHARED: fedavg_shared(state, updates, c.server_lr), **average_heads(state, updates, c.server_lr)}
        if c.track_task_vectors:
            vectors.update(accumulate_task_vectors(state, updates, c.server_lr))
        return state.next(vectors)


def delta_update(downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer,
                 options: Callable[[str], dict] = lambda task: {}) -> ClientUpdate:
    """Train the client's tasks in turn (`train_tasks_in_turn`) and send the change of the shared
    modules and of each head."""
    shared, heads, metrics = train_tasks_in_turn(downlink, job, trainer, options=options)
    vectors = {SHARED: shared - downlink[SHARED]}
    vectors.update({head_name(t): h - downlink[head_name(t)] for t, h in heads.items()})
    return ClientUpdate(job.client_id, job.round, vectors, job.num_samples(), metrics)


def negate_forgotten(updates: list[ClientUpdate], tasks: Iterable[str],
                     clients: Iterable[int] = ()) -> list[ClientUpdate]:
    """Unlearning by negation: every vector of a client holding a task in `tasks`, or listed in
    `clients`, flips sign, so aggregation moves the model away from what its training would add."""
    tasks, clients = set(tasks), set(clients)
    return [dataclasses.replace(u, vectors={k: -v for k, v in u.vectors.items()})
            if tasks & set(u.num_samples) or u.client_id in clients else u for u in updates]


def accumulate_task_vectors(state: GlobalState, updates: list[ClientUpdate], server_lr: float) -> dict[str, TaskVector]:
    """Each task's share of this round's shared-module step, added to its running total: a client's
    (sample-weighted) change is split over its tasks by their sample counts, so the task vectors sum
    to the movement of the shared modules since round 0."""
    total = sum(u.total_samples for u in updates)
    out = {}
    for task, holders in updates_by_task(updates).items():
        key = tracked_task_vector_name(task)
        step = state.vectors[key]
        for u in holders:
            step = step + u.vectors[SHARED] * (server_lr * u.num_samples[task] / total)
        out[key] = step
    return out


def train_tasks_in_turn(downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer,
                        options: Callable[[str], dict] = lambda task: {}
                        ) -> tuple[TaskVector, dict[str, TaskVector], dict]:
    """One model for all of a client's tasks: train each task (in name order) starting from the
    shared modules the previous task left and the task's own head (`options(task)`: extra
    `trainer.train` arguments). Returns the final shared modules, each task's trained head, and the
    train losses and the sum of learning rates over each task's steps (`<task>/lr_sum`)."""
    shared = downlink[SHARED]
    heads, metrics = {}, {}
    for task in job.tasks:
        start = TaskVector({**shared, **downlink[head_name(task)]})
        trained, m = trainer.train(start, job.data[task], seed=job.seed_for(task), **options(task))
        shared = trained.filter(lambda k: k in downlink[SHARED])
        heads[task] = trained.filter(lambda k: k not in downlink[SHARED])
        metrics[f"{task}/train_loss"] = m["train_loss"]
        metrics[f"{task}/lr_sum"] = m.get("lr_sum", 0.0)
    return shared, heads, metrics


@dataclass
class FedProxConfig(FedAvgConfig):
    proximal_mu: float = option(0.01, "FedProx's μ: clients add (μ/2)·‖θ − θ_s‖² to their loss", minimum=0)


@register_strategy
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"
    config_class = FedProxConfig

    def _train_options(self, downlink, job, task) -> dict:
        options = super()._train_options(downlink, job, task)
        return {**options, "objectives": [*options.get("objectives", []), ProximalTerm(self.config.proximal_mu)]}
