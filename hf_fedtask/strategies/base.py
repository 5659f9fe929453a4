"""The shape every algorithm takes: a pair of functions over task vectors.

    downlink(state, client, tasks) -> named vectors          # what the server sends one client
    client_update(downlink, job, trainer) -> ClientUpdate    # runs on the client
    server_aggregate(state, [ClientUpdate]) -> GlobalState   # runs on the server

Engines (the in-process simulator today; Flower or multi-process later) only move these values
around, so a strategy file reads like its paper's algorithm box. A client sees nothing but its
downlink, its own data and its private `store` (personal layers that never leave it).
"""

from __future__ import annotations

import dataclasses
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from datasets import Dataset

from hf_fedtask.client.trainer import LocalTrainer
from hf_fedtask.data.task import Task
from hf_fedtask.errors import ConfigError
from hf_fedtask.model.host import PeftHost
from hf_fedtask.merge import weighted_average
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate

SHARED = "shared"


def head_name(task: str) -> str:
    """Name of the vector holding `task`'s classification head in states and updates."""
    return f"head/{task}"


@dataclass
class GlobalState:
    """Server state after `round` finished rounds: named vectors (e.g. `shared` PEFT modules and one
    `head/<task>` per task) plus JSON-able scalars (e.g. the task allocation A(n, t))."""

    round: int
    vectors: dict[str, TaskVector]
    scalars: dict = field(default_factory=dict)

    @property
    def allocation(self) -> dict[int, list[str]]:
        """Client id -> the tasks it holds."""
        return {int(c): tasks for c, tasks in self.scalars["allocation"].items()}

    def holders(self, task: str) -> list[int]:
        return [c for c, tasks in self.allocation.items() if task in tasks]


ClientStore = dict[str, TaskVector]
"""A client's private, persistent tensors (e.g. FedPer's personal layers). The engine keeps one per
client and checkpoints it; the server never reads it."""


@dataclass
class ClientJob:
    """What one client works on in one round: its tokenized train data per task, a seed, the seeded
    PEFT init every task vector is measured from and each task's initial head (both rebuilt by
    clients from the broadcast seed), and the client's private store."""

    client_id: int
    round: int
    data: dict[str, Dataset]
    seed: int
    origin: TaskVector | None = None
    initial_heads: dict[str, TaskVector] = field(default_factory=dict)
    store: ClientStore = field(default_factory=dict)

    def seed_for(self, task: str) -> int:
        """A per-(run seed, round, client, task) seed: identical whatever ran before it."""
        task_id = zlib.crc32(task.encode())
        return int(np.random.SeedSequence([self.seed, self.round, self.client_id, task_id]).generate_state(1)[0])

    @property
    def tasks(self) -> list[str]:
        return sorted(self.data)

    def num_samples(self) -> dict[str, int]:
        return {t: len(d) for t, d in self.data.items()}


class Strategy(ABC):
    """Base class: registry, hyperparameters, and the default layout (shared modules + one head per
    task, both sent to clients as absolute parameters)."""

    name: ClassVar[str]
    paper: ClassVar[str] = ""
    per_task_modules: ClassVar[bool] = False  # one PEFT module per task: also exported as one multi-adapter folder

    def hyperparameters(self) -> dict:
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}

    def init_state(self, host: PeftHost, tasks: list[Task], seed: int, allocation: dict[int, list[str]]) -> GlobalState:
        vectors = {SHARED: host.initial_shared()}
        for i, task in enumerate(tasks):
            vectors[head_name(task.name)] = host.initial_head(task.num_labels, seed=seed * 1000 + i)
        return GlobalState(round=0, vectors=vectors, scalars={"allocation": {str(c): t for c, t in allocation.items()}})

    def task_parameters(self, state: GlobalState, task: str, stores: dict[int, ClientStore] | None = None) -> TaskVector:
        """The full PEFT state (shared modules + this task's head) used to evaluate and export `task`.
        Personalized strategies combine the holders' `stores`."""
        return TaskVector({**state.vectors[SHARED], **state.vectors[head_name(task)]})

    def downlink(self, state: GlobalState, client_id: int, tasks: list[str]) -> dict[str, TaskVector]:
        """Exactly what the server sends `client_id` (holding `tasks`) this round."""
        return {SHARED: state.vectors[SHARED], **heads_of(state, tasks)}

    def update_templates(self, state: GlobalState, client_id: int, tasks: list[str]) -> dict[str, TaskVector]:
        """What that client's update must contain (keys, shapes, dtypes); by default its downlink."""
        return self.downlink(state, client_id, tasks)

    def linearization_point(self, state: GlobalState, task: str) -> TaskVector | None:
        """For strategies that train linearized models (NTKFedAvg): the point `task`'s model is
        linearized around, so it is evaluated as f_lin at `task_parameters`; None = the ordinary model."""
        return None

    @abstractmethod
    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate: ...

    @abstractmethod
    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState: ...


def heads_of(state: GlobalState, tasks: list[str]) -> dict[str, TaskVector]:
    """The `head/<task>` vectors of `tasks`."""
    return {head_name(t): state.vectors[head_name(t)] for t in tasks}


def average_heads(state: GlobalState, updates: Iterable[ClientUpdate], server_lr: float = 1.0) -> dict[str, TaskVector]:
    """Each task's head moved by `server_lr` times the sample-weighted mean of the head changes
    (`head/<task>` in the updates) of the clients holding that task; heads of absent tasks stay."""
    updates = list(updates)
    heads = {}
    for task in sorted({t for u in updates for t in u.num_samples}):
        holders = [u for u in updates if task in u.num_samples]
        key = head_name(task)
        mean = weighted_average((u.vectors[key] for u in holders), (u.num_samples[task] for u in holders))
        heads[key] = state.vectors[key] + server_lr * mean
    return heads


STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    STRATEGIES[cls.name] = cls
    return cls


def build_strategy(name: str, options: dict) -> Strategy:
    """Instantiate a registered strategy, passing the options that are its dataclass fields."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}")
    cls = STRATEGIES[name]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    strategy = cls(**{k: v for k, v in options.items() if k in fields})
    if hasattr(strategy, "check"):
        strategy.check()
    return strategy
