"""The shape every algorithm takes: a config dataclass and a few functions over task vectors.

    downlink(state, client, tasks) -> named vectors          # exactly what the server sends one client
    client_update(downlink, job, trainer) -> ClientUpdate    # runs on the client
    server_aggregate(state, [ClientUpdate]) -> GlobalState   # runs on the server

Engines (in-process, Flower simulation, Flower deployment) only move these values, so a strategy
reads like its paper's algorithm box. A client sees nothing but its downlink, its own data and its
private `store`. Beyond training, a round may ask clients for statistics without training
(`message_kind` QUERY, answered by `client_query`), tasks may be evaluated on their holders
(`client_task_parameters`, for personal layers), and a strategy's state layout may change between
phases (`state_template`). What a strategy supports is declared in `capabilities` (a function of its
options where they decide it: `configured_capabilities`), and engines read nothing else; a capability
that needs more than these functions comes with a hook class the strategy derives from
(`Linearized`, `CompactExport`, `Packaging`, `ClientRemoval`; `hooks_declared` pairs them). Its
options live in its config class (`config_class`), typed and validated on construction. The steps
several strategies share (`fedavg_shared`, `average_heads`, `task_model`, `task_point`) are at the end.
"""

from __future__ import annotations

import dataclasses
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from hf_fedtask.core.kinds import EVALUATE, QUERY, TRAIN
from hf_fedtask.core.state import HEAD, SHARED, ClientStore, GlobalState, head_name, point_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError, ProtocolError
from hf_fedtask.merge import weighted_average
from hf_fedtask.privacy.hooks import ClientPrivacy
from hf_fedtask.strategies.configs import StrategyConfig
from hf_fedtask.strategies.registry import (  # the registry, kept in a module without torch
    STRATEGIES,
    build_strategy_config,
    option_names,
    register_strategy,
    strategy_class,
)

if TYPE_CHECKING:
    from datasets import Dataset

    from hf_fedtask.client.trainer import LocalTrainer
    from hf_fedtask.data.task import Task
    from hf_fedtask.model.host import PeftHost

__all__ = ["SHARED", "TRAIN", "QUERY", "EVALUATE", "Capabilities", "ClientJob", "ClientRemoval", "ClientStore",
           "CompactExport", "GlobalState", "Linearized", "Packaging", "Strategy", "StrategyConfig", "as_point",
           "average_heads", "build_strategy", "configured_capabilities", "fedavg_shared", "head_name",
           "hooks_declared", "register_strategy", "shared_mean", "task_model", "task_point", "updates_by_task",
           "AggregatedState", "aggregation_diagnostics", "STRATEGIES", "build_strategy_config", "option_names",
           "strategy_class"]


@dataclass(frozen=True)
class Capabilities:
    """What a strategy supports, declared: engines, exporters and the CLI consult this, never probe. A
    capability that needs a hook beyond `Strategy`'s functions names it; the strategy derives from that
    hook class exactly when it declares the capability (`hooks_declared`)."""

    federated_unlearning: bool = False  # forget_tasks / forget_clients: holders' updates negated
    task_vector_tracking: bool = False  # track_task_vectors: one-shot negation of a task afterwards
    secure_aggregation: bool = False  # uploads are masked on the clients: the server receives only their sum
    client_evaluation: bool = False  # tasks are evaluated on their holders (personal layers stay there)
    personal_state: bool = False  # task models include client-private layers: exports need the clients' stores
    personalization: bool = True  # FedAvg+Local fine-tuning from the task models
    linearized: bool = False  # evaluated as a linearized model (and exported as one beside the adapter): `Linearized`
    client_removal: bool = False  # a client removed from a finished run on the server alone: `ClientRemoval`
    # client-level DP (dp_clip, hf_fedtask.privacy): uploads clipped jointly, noise on the aggregated sums, uniform
    # weights: `hf_fedtask.privacy.hooks.ClientPrivacy`
    client_dp: bool = False
    # why the strategy needs a classifier's outputs and so refuses a causal LM (None: it runs on one too)
    classifier_only: str | None = None
    # + compact (`CompactExport`), multi_adapter (per-task modules), linearized, tct (`Packaging`)
    exports: tuple[str, ...] = ("adapters",)


class configured_capabilities:  # noqa: N801  (used as a decorator, like `property`)
    """`capabilities` that depend on the strategy's options (e.g. FedYolo's `secure_aggregation`), declared
    as a function of its config. Read on a strategy it answers for that strategy's options; read on the
    class, for the default options.

        @configured_capabilities
        def capabilities(config: MyConfig) -> Capabilities:
            return Capabilities(secure_aggregation=config.secure_aggregation)
    """

    def __init__(self, declare: Callable[[StrategyConfig], Capabilities]):
        self.declare = declare
        self.__doc__ = declare.__doc__

    def __get__(self, strategy: Strategy | None, cls: type[Strategy]) -> Capabilities:
        return self.declare(strategy.config if strategy is not None else cls.config_class())


@dataclass
class ClientJob:
    """What one client works on in one round: its prepared data per task, a seed, the seeded PEFT
    init every task vector is measured from and each task's initial head (both rebuilt by clients
    from the broadcast seed), and the client's private store."""

    client_id: int
    round: int
    data: dict[str, Dataset]
    seed: int
    origin: TaskVector | None = None
    initial_heads: dict[str, TaskVector] = field(default_factory=dict)
    store: ClientStore = field(default_factory=dict)
    query: str = ""  # for QUERY messages: what the server asks

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
    """Base class: config, capabilities and the default layout (shared modules + one head per task,
    both sent to clients as absolute parameters)."""

    name: ClassVar[str]
    paper: ClassVar[str] = ""
    config_class: ClassVar[type[StrategyConfig]] = StrategyConfig
    capabilities: ClassVar[Capabilities] = Capabilities()  # or a `configured_capabilities`

    def __init__(self, config: StrategyConfig | None = None, **options):
        if config is not None and options:
            raise TypeError("give a config or options, not both")
        if config is not None and not isinstance(config, self.config_class):
            raise ConfigError(f"strategy {self.name!r} takes a {self.config_class.__name__}, "
                              f"got {type(config).__name__}")
        self.config = config if config is not None else self.config_class(**options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    def hyperparameters(self) -> dict:
        return dataclasses.asdict(self.config)

    def check_run(self, config) -> None:
        """Refuse run settings (a `RunConfig`) this strategy cannot honour, with a ConfigError, before
        anything is written. Everything is accepted by default."""

    @property
    def server_fraction(self) -> float:
        """The share of each task's training split the server keeps for itself (never sent to a client);
        0 for strategies whose server holds no data."""
        return 0.0

    def server_step(self, state: GlobalState, env) -> GlobalState:
        """Work the server does alone at the start of a round, before any message (F²L²'s pretraining
        on its own data, through `env`, the run's `Environment`); the state as it is by default."""
        return state

    # -- state -------------------------------------------------------------------------------------
    def init_state(self, host: PeftHost, tasks: list[Task], seed: int, allocation: dict[int, list[str]]) -> GlobalState:
        vectors = {SHARED: host.initial_shared()}
        for i, task in enumerate(tasks):
            vectors[head_name(task.name)] = host.initial_head(task.num_labels, seed=seed * 1000 + i)
        return GlobalState(round=0, vectors=vectors, scalars={"allocation": {str(c): t for c, t in allocation.items()}})

    def state_template(self, initial: GlobalState, scalars: dict) -> GlobalState:
        """The layout (names, shapes, dtypes) of a state whose scalars are `scalars` (e.g. its phase);
        checkpoints are validated against it. One layout for every round by default."""
        return initial

    def task_parameters(self, state: GlobalState, task: str,
                        stores: dict[int, ClientStore] | None = None) -> TaskVector:
        """The full PEFT state (shared modules + this task's head) used to evaluate and export `task`."""
        return task_model(state.vectors, task)

    def predict(self, state: GlobalState, task: str, host: PeftHost, data: Dataset,
                batch_size: int) -> np.ndarray | None:
        """Predictions for `task` on prepared `data` when the task's model is not the host model carrying
        `task_parameters` (e.g. TCT's linear model over eNTK features); None: the host model's."""
        return None

    # -- communication ------------------------------------------------------------------------------
    def message_kind(self, state: GlobalState) -> str:
        """What the next round asks of clients: TRAIN (`client_update`) or QUERY (`client_query`)."""
        return TRAIN

    def query_name(self, state: GlobalState) -> str:
        """For QUERY rounds: what is asked (passed to the client as `job.query`)."""
        return ""

    def downlink(self, state: GlobalState, client_id: int, tasks: list[str]) -> dict[str, TaskVector]:
        """Exactly what the server sends `client_id` (holding `tasks`) this round."""
        return {SHARED: state.vectors[SHARED], **state.heads(tasks)}

    def update_templates(self, state: GlobalState, client_id: int, tasks: list[str]) -> dict[str, TaskVector]:
        """What that client's reply must contain (keys, shapes, dtypes); by default its downlink. With
        `capabilities.secure_aggregation` they are masked, so every client's must be the same."""
        return self.downlink(state, client_id, tasks)

    # -- client -------------------------------------------------------------------------------------
    @abstractmethod
    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate: ...

    def trains_clients_together(self, trainer: LocalTrainer) -> bool:
        """Whether `client_updates` may train several clients together on `trainer` (then the in-process engine
        hands a round's clients over at once)."""
        return False

    def client_updates(self, downlinks: list[dict[str, TaskVector]], jobs: list[ClientJob],
                       trainer: LocalTrainer) -> list[ClientUpdate]:
        """`client_update` for several clients of one process: a strategy may train them together (FedAvg:
        `LocalTrainer.train_many`)."""
        return [self.client_update(d, j, trainer) for d, j in zip(downlinks, jobs)]

    def client_query(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        """Answer the QUERY `job.query` (statistics or gradients, no training)."""
        raise ProtocolError(f"strategy {self.name!r} sends no queries")

    def client_task_parameters(self, downlink: dict[str, TaskVector], job: ClientJob, task: str) -> TaskVector:
        """For strategies with client evaluation: the client's own model of `task` (its store + downlink)."""
        raise ProtocolError(f"strategy {self.name!r} evaluates on the server")

    # -- server -------------------------------------------------------------------------------------
    @abstractmethod
    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState: ...


@dataclass
class AggregatedState(GlobalState):
    """A state as `server_aggregate` may return it: with what the aggregation measured (`diagnostics`,
    JSON-able, e.g. FedAvg's LoRA factor error), which the round's metrics record carries under
    `aggregation`. They describe how the state was reached, not the state: never checkpointed, and
    `next` leaves them behind."""

    diagnostics: dict = field(default_factory=dict, compare=False)


def aggregation_diagnostics(state: GlobalState) -> dict:
    """What the aggregation that produced `state` measured ({} for a plain `GlobalState`)."""
    return dict(state.diagnostics) if isinstance(state, AggregatedState) else {}


# -- hooks: what a capability needs beyond the functions above ----------------------------------------

class Linearized:
    """Hook of `capabilities.linearized`: each task's model is the first-order expansion of the network
    around a point the state keeps beside it (`point_name`: `linearized_at/shared`, `linearized_at/head/<task>`),
    evaluated (and exported) as such."""

    @property
    def linearization(self) -> str:
        """What is linearized (`hf_fedtask.model.linearize.MODES`): the whole network by default."""
        return "network"

    def linearization_point(self, state: GlobalState, task: str) -> TaskVector | None:
        """The point `task`'s model is linearized around (`task_point` of the state); None in a phase
        that has none yet (the task's model is then the ordinary one)."""
        return task_point(state.vectors, task)


class CompactExport(ABC):
    """Hook of the "compact" export: all tasks stored as one unified vector, a mask and a rescaler per
    task (`hf_fedtask.export.compact`)."""

    @abstractmethod
    def compact_form(self, state: GlobalState) -> dict:
        """The compact form as `hf_fedtask.export.compact.save_compact` arguments."""

    @abstractmethod
    def compact_task_parameters(self, state: GlobalState, task: str) -> TaskVector:
        """`task`'s parameters as the compact form gives them (its accuracy is reported beside
        `task_parameters`' as `<metric>_compact`)."""


class Packaging(ABC):
    """Hook of the "tct" export: a task's model that is no adapter (TCT's feature network and linear model)."""

    @abstractmethod
    def package(self, state: GlobalState, task: str) -> tuple[TaskVector, dict] | None:
        """(network, linear model) as `hf_fedtask.export.tct.save_tct` writes them; None while there is none."""


class ClientRemoval(ABC):
    """Hook of `capabilities.client_removal`: remove one client from a finished run on the server alone."""

    @abstractmethod
    def remove_client(self, state: GlobalState, env, client: int, options=None):
        """The state without `client`'s contribution and how it was obtained (`.state` the new state)."""


def hooks_declared(capabilities: Capabilities) -> dict[type, bool]:
    """Each hook class and whether `capabilities` declare it: a strategy derives from a hook class exactly
    when its capabilities declare it (the strategy contract test holds every registered strategy to this)."""
    return {Linearized: capabilities.linearized,
            CompactExport: "compact" in capabilities.exports,
            Packaging: "tct" in capabilities.exports,
            ClientRemoval: capabilities.client_removal,
            ClientPrivacy: capabilities.client_dp}


# -- steps several strategies share ----------------------------------------------------------------------

def task_model(vectors: Mapping[str, TaskVector], task: str) -> TaskVector:
    """`task`'s model in `vectors` (a state's, a downlink's): the shared modules and the task's head."""
    return TaskVector({**vectors[SHARED], **vectors[head_name(task)]})


def task_vectors(model: TaskVector, vectors: Mapping[str, TaskVector], task: str) -> dict[str, TaskVector]:
    """`task_model`'s inverse: `model` (shared modules and `task`'s head as one vector) split into the
    entries of `vectors` it replaces, the shared modules by `vectors`' own keys and the head."""
    shared = vectors[SHARED]
    return {SHARED: model.filter(lambda k: k in shared), head_name(task): model.filter(lambda k: k not in shared)}


def task_point(vectors: Mapping[str, TaskVector], task: str) -> TaskVector:
    """The point `task`'s model is linearized around, as `vectors` (a state's, a downlink's) keep it
    (`as_point`): `task_model` of the point's copies."""
    return TaskVector({**vectors[point_name(SHARED)], **vectors[point_name(head_name(task))]})


def as_point(vectors: Mapping[str, TaskVector]) -> dict[str, TaskVector]:
    """The shared modules and heads among `vectors`, renamed as a linearization point (`point_name`)."""
    return {point_name(k): v for k, v in vectors.items() if k == SHARED or k.startswith(HEAD)}


def shared_mean(updates: Iterable[ClientUpdate], uniform: bool = False) -> TaskVector:
    """The sample-weighted mean of the clients' changes of the shared modules (`uniform`: every client
    weighs 1, as client-level DP needs)."""
    updates = list(updates)
    weights = [1.0] * len(updates) if uniform else [u.total_samples for u in updates]
    return weighted_average([u.vectors[SHARED] for u in updates], weights)


def fedavg_shared(state: GlobalState, updates: Iterable[ClientUpdate], server_lr: float = 1.0,
                  uniform: bool = False) -> TaskVector:
    """FedAvg's step of the shared modules: moved by `server_lr` times the sample-weighted mean of the
    clients' changes (all clients: every client trains the shared modules; `uniform`: every client weighs 1)."""
    return state.vectors[SHARED] + server_lr * shared_mean(updates, uniform)


def updates_by_task(updates: Iterable[ClientUpdate]) -> dict[str, list[ClientUpdate]]:
    """Each task (in name order) with the updates of the clients that hold it."""
    updates = list(updates)
    return {task: [u for u in updates if task in u.num_samples]
            for task in sorted({t for u in updates for t in u.num_samples})}


def average_heads(state: GlobalState, updates: Iterable[ClientUpdate], server_lr: float = 1.0) -> dict[str, TaskVector]:
    """Each task's head moved by `server_lr` times the sample-weighted mean of the head changes
    (`head/<task>` in the updates) of the clients holding that task; heads of absent tasks stay."""
    heads = {}
    for task, holders in updates_by_task(updates).items():
        key = head_name(task)
        mean = weighted_average([u.vectors[key] for u in holders], (u.num_samples[task] for u in holders))
        heads[key] = state.vectors[key] + server_lr * mean
    return heads


def build_strategy(name: str, options: dict | None = None) -> Strategy:
    """Instantiate a registered strategy from its name and options."""
    return strategy_class(name)(build_strategy_config(name, options or {}))
