"""The shape every algorithm takes: a pair of functions over task vectors.

    client_update(state, job, trainer) -> ClientUpdate      # runs on the client
    server_aggregate(state, [ClientUpdate]) -> GlobalState  # runs on the server

Engines (the in-process simulator today; Flower or multi-process later) only move these values
around, so a strategy file reads like its paper's algorithm box.
"""

from __future__ import annotations

import dataclasses
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from datasets import Dataset

from ..client import LocalTrainer
from ..data.task import Task
from ..errors import ConfigError
from ..host import PeftHost
from ..taskvector import TaskVector
from ..update import ClientUpdate

SHARED = "shared"


def head_name(task: str) -> str:
    """Name of the vector holding `task`'s classification head in states and updates."""
    return f"head/{task}"


@dataclass
class GlobalState:
    """Server state after `round` finished rounds: named vectors of *absolute* parameters (e.g.
    `shared` PEFT modules and one `head/<task>` per task) plus JSON-able scalars."""

    round: int
    vectors: dict[str, TaskVector]
    scalars: dict = field(default_factory=dict)


@dataclass
class ClientJob:
    """What one client works on in one round: its tokenized train data per task, and a seed."""

    client_id: int
    round: int
    data: dict[str, Dataset]
    seed: int

    def seed_for(self, task: str) -> int:
        """A per-(run seed, round, client, task) seed: identical whatever ran before it."""
        task_id = zlib.crc32(task.encode())
        return int(np.random.SeedSequence([self.seed, self.round, self.client_id, task_id]).generate_state(1)[0])


class Strategy(ABC):
    """Base class: registry, hyperparameters, and the default state layout (shared + heads)."""

    name: ClassVar[str]
    paper: ClassVar[str] = ""

    def hyperparameters(self) -> dict:
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}

    def init_state(self, host: PeftHost, tasks: list[Task], seed: int) -> GlobalState:
        vectors = {SHARED: host.initial_shared()}
        for i, task in enumerate(tasks):
            vectors[head_name(task.name)] = host.initial_head(task.num_labels, seed=seed * 1000 + i)
        return GlobalState(round=0, vectors=vectors)

    def task_parameters(self, state: GlobalState, task: str) -> TaskVector:
        """The full PEFT state (shared modules + this task's head) used to evaluate/export `task`."""
        return TaskVector({**state.vectors[SHARED], **state.vectors[head_name(task)]})

    def update_templates(self, state: GlobalState, tasks: list[str]) -> dict[str, TaskVector]:
        """What an update from a client holding `tasks` must contain (keys, shapes, dtypes)."""
        return {SHARED: state.vectors[SHARED], **{head_name(t): state.vectors[head_name(t)] for t in tasks}}

    @abstractmethod
    def client_update(self, state: GlobalState, job: ClientJob, trainer: LocalTrainer) -> ClientUpdate: ...

    @abstractmethod
    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState: ...


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
    return cls(**{k: v for k, v in options.items() if k in fields})
