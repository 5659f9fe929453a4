"""FedPer (Arivazhagan et al., 2019): the last transformer block(s) and the classification heads are
personal — they stay on the client (in its private store) and never travel; the rest of the PEFT
modules are averaged as in FedAvg.

Evaluation happens on the clients: every holder of a task evaluates its own model (global modules,
its personal layers, its head) on the task's test split, and a task's metric is the mean over its
holders. Exporting one adapter per task needs one set of personal layers per task: the export uses
the mean of the holders' personal layers, which only an engine that hosts the clients' stores (the
in-process one) can form. Holders that have not trained yet contribute the seeded init.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from hf_fedtask.core.state import PERSONAL
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError
from hf_fedtask.merge import weighted_average
from hf_fedtask.strategies.base import (
    SHARED,
    Capabilities,
    ClientJob,
    GlobalState,
    Strategy,
    head_name,
    register_strategy,
    shared_mean,
)
from hf_fedtask.strategies.configs import FedPerConfig
from hf_fedtask.strategies.fedavg import train_tasks_in_turn

if TYPE_CHECKING:
    from hf_fedtask.client.trainer import LocalTrainer

_BLOCK_INDEX = re.compile(r"\.(\d+)\.")


def last_block_keys(keys: list[str], blocks: int) -> list[str]:
    """The keys inside the last `blocks` numbered blocks (e.g. `encoder.layer.5.`), by the first
    integer path component of each key."""
    indices = {k: int(m.group(1)) for k in keys if (m := _BLOCK_INDEX.search(k))}
    if not indices:
        raise ConfigError("config: fedper needs PEFT modules inside numbered transformer blocks (e.g. LoRA); "
                          "this PEFT method has none")
    last = max(indices.values())
    return [k for k, i in indices.items() if i > last - blocks]


@register_strategy
class FedPer(Strategy):
    name = "fedper"
    paper = "Arivazhagan et al., Federated Learning with Personalization Layers, arXiv 1912.00818, 2019"
    config_class = FedPerConfig
    capabilities = Capabilities(client_evaluation=True, personal_state=True)

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        shared = list(state.vectors[SHARED])
        head = [k for k in shared if k in host.head_keys]  # a shared output space's head stays personal too
        state.scalars["personal_keys"] = last_block_keys([k for k in shared if k not in head],
                                                         self.config.personal_blocks) + head
        return state

    def _split(self, state: GlobalState, tv: TaskVector) -> tuple[TaskVector, TaskVector]:
        personal = set(state.scalars["personal_keys"])
        return tv.filter(lambda k: k not in personal), tv.filter(lambda k: k in personal)

    def downlink(self, state, client_id, tasks) -> dict[str, TaskVector]:
        return {SHARED: self._split(state, state.vectors[SHARED])[0]}

    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        personal = job.store.get(PERSONAL) or job.origin.filter(lambda k: k not in downlink[SHARED])
        local = {SHARED: TaskVector({**downlink[SHARED], **personal})}
        local.update({head_name(t): job.store.get(head_name(t)) or job.initial_heads[t] for t in job.tasks})
        shared, heads, metrics = train_tasks_in_turn(local, job, trainer)
        job.store[PERSONAL] = shared.filter(lambda k: k in personal)
        job.store.update({head_name(t): h for t, h in heads.items()})
        update = {SHARED: shared.filter(lambda k: k in downlink[SHARED]) - downlink[SHARED]}
        return ClientUpdate(job.client_id, job.round, update, job.num_samples(), metrics)

    def client_task_parameters(self, downlink: dict[str, TaskVector], job: ClientJob, task: str) -> TaskVector:
        """The client's own model of `task`: the global modules, its personal layers and its head
        (the seeded init where it has not trained yet)."""
        personal = job.store.get(PERSONAL) or job.origin.filter(lambda k: k not in downlink[SHARED])
        merged = {**downlink[SHARED], **personal}
        head = job.store.get(head_name(task)) or job.initial_heads[task]
        return TaskVector({**{k: merged[k] for k in job.origin}, **head})

    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        global_part, personal_init = self._split(state, state.vectors[SHARED])  # FedAvg's step of the global part
        moved = global_part + self.config.server_lr * shared_mean(updates)
        return state.next({SHARED: TaskVector({**moved, **personal_init})})

    def task_parameters(self, state, task, stores=None) -> TaskVector:
        """The task's exported model: the global modules with the mean of its holders' personal
        layers and heads (`stores`: the clients' stores, which only an engine hosting them has)."""
        if stores is None:
            raise ConfigError("fedper: a task's model holds its clients' personal layers, which stay on the clients "
                              "in this engine; its metrics are the holders' own (metrics.jsonl)")
        global_part, personal_init = self._split(state, state.vectors[SHARED])
        trained = [stores[c] for c in state.holders(task) if head_name(task) in stores.get(c, {})]
        if not trained:
            return TaskVector({**global_part, **personal_init, **state.vectors[head_name(task)]})
        personal = weighted_average([s[PERSONAL] for s in trained], [1.0] * len(trained))
        head = weighted_average([s[head_name(task)] for s in trained], [1.0] * len(trained))
        merged = {**global_part, **personal}
        return TaskVector({**{k: merged[k] for k in state.vectors[SHARED]}, **head})
