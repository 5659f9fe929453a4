"""FedAvg (McMahan et al., 2017) and FedProx (Li et al., 2020) over PEFT task vectors.

Client: for each task it holds (in name order), start from the server's shared modules (as left
by the previous task) and the task's head, train locally, and send the change of the shared
modules and of each head. Server: the shared modules move by α times the sample-weighted mean of
all clients' changes; each head by α times the mean over the clients that hold its task.

Federated unlearning (NTKFedAvg's Alg. 1, lines 8–9) is part of the server step: the updates of
clients holding a task in `forget_tasks`, or listed in `forget_clients`, are negated before
aggregation. With `track_task_vectors`, the server also keeps each task's accumulated share of the
shared modules' movement (`task_vector/<task>`), the task vector a one-shot negation subtracts.

LoRA (`lora_aggregation`, FedAvg and FedProx): by default A and B are averaged on their own (FedIT-style
factor averaging, as FlowerTune and OpenFedLLM do), and each round reports how far B̄·Ā lands from the
exact step of the products (`lora_factor_error`). `product` takes that exact step instead: the global
B·A moves by α times the sample-weighted mean of the clients' changes of B_i·A_i, re-factorized to rank r
by a truncated SVD computed from the factors (FlexLoRA: Bai et al., 2024; `hf_fedtask.merge.lora_product`),
reporting the truncation's residual (`lora_truncation_residual`). Unlearning negates a client's change of
the product there. NTKFedAvg and NTKFedProx do not offer it: their clients train a model affine in A and B
(the linearized network, or L-LoRA), for which averaging the factors is already exact. With `product`, clients
may hold different ranks (`lora_ranks`, FlexLoRA: `hf_fedtask.strategies.hetero_rank`): each receives the
global product truncated to its rank and trains it in its own adapter; the server re-factorizes to `lora_r`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from hf_fedtask.client.objectives import ProximalTerm
from hf_fedtask.core.state import tracked_task_vector_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError
from hf_fedtask.merge.lora_product import as_factors, factor_step_error, lora_pairs, product_step
from hf_fedtask.privacy.hooks import ClientPrivacy
from hf_fedtask.strategies.base import (
    SHARED,
    AggregatedState,
    Capabilities,
    ClientJob,
    GlobalState,
    Strategy,
    average_heads,
    fedavg_shared,
    head_name,
    register_strategy,
    updates_by_task,
)
from hf_fedtask.strategies.configs import FACTORS, PRODUCT, FedAvgLoRAConfig, FedProxLoRAConfig

# `NAME as NAME`: re-exported, defined here before hf_fedtask.strategies.configs
from hf_fedtask.strategies.configs import LORA_AGGREGATIONS as LORA_AGGREGATIONS
from hf_fedtask.strategies.configs import FedAvgConfig as FedAvgConfig
from hf_fedtask.strategies.configs import FedProxConfig as FedProxConfig
from hf_fedtask.strategies.hetero_rank import at_rank, check_ranks, client_rank, mixed_rank_step, truncate_shared

if TYPE_CHECKING:
    from hf_fedtask.client.trainer import LocalTrainer


@register_strategy
class FedAvg(Strategy, ClientPrivacy):
    name = "fedavg"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
    config_class = FedAvgLoRAConfig
    capabilities = Capabilities(federated_unlearning=True, task_vector_tracking=True, client_dp=True)

    @property
    def lora_aggregation(self) -> str:
        """`lora_aggregation` where the strategy offers it (`FedAvgLoRAConfig`); "factors" for the family
        members that do not."""
        return self.config.lora_aggregation if isinstance(self.config, FedAvgLoRAConfig) else FACTORS

    @property
    def lora_ranks(self) -> list[int] | None:
        """The clients' LoRA ranks (`lora_ranks`, `hf_fedtask.strategies.hetero_rank`) where the strategy offers
        them and they are set; None: every client at the server's rank."""
        return self.config.lora_ranks if isinstance(self.config, FedAvgLoRAConfig) else None

    def check_run(self, config) -> None:
        super().check_run(config)
        if self.lora_aggregation == PRODUCT and config.peft_method != "lora":
            raise ConfigError(f"lora_aggregation product averages LoRA's B·A products: peft_method "
                              f"{config.peft_method!r} has no LoRA factors (use peft_method lora, or "
                              "lora_aggregation factors)")
        if self.lora_ranks:
            check_ranks(self.lora_ranks, config)

    def downlink(self, state: GlobalState, client_id: int, tasks: list[str]) -> dict[str, TaskVector]:
        """The state's shared modules and the client's heads; with `lora_ranks`, the LoRA modules truncated to
        the client's rank (`hf_fedtask.strategies.hetero_rank.truncate_shared`)."""
        out = super().downlink(state, client_id, tasks)
        if self.lora_ranks:
            out[SHARED] = truncate_shared(out[SHARED], client_rank(self.lora_ranks, client_id), state.round)
        return out

    def _train_options(self, downlink: dict[str, TaskVector], job: ClientJob, task: str) -> dict:
        """Extra `LocalTrainer.train` arguments for `task` (an objective, a linearization point)."""
        return {}

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        if self.config.track_task_vectors:
            state.vectors.update({tracked_task_vector_name(t.name): state.vectors[SHARED].zeros_like() for t in tasks})
        return state

    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        options = lambda task: self._train_options(downlink, job, task)  # noqa: E731
        if self.lora_ranks:  # the client's own rank: its own adapter on the shared host
            with at_rank(trainer.host, client_rank(self.lora_ranks, job.client_id)):
                return delta_update(downlink, job, trainer, options=options)
        return delta_update(downlink, job, trainer, options=options)

    def trains_clients_together(self, trainer: LocalTrainer) -> bool:
        """FedAvg's plain local training (no objective, linearization or per-client rank) on a trainer that
        batches clients."""
        return (trainer.batches_clients and type(self).client_update is FedAvg.client_update and not self.lora_ranks
                and type(self)._train_options is FedAvg._train_options)

    def client_updates(self, downlinks: list[dict[str, TaskVector]], jobs: list[ClientJob],
                       trainer: LocalTrainer) -> list[ClientUpdate]:
        """`client_update` of each job; clients holding one task, of the same size, trained together where the
        trainer batches clients (`LocalTrainer.train_many`) and the local training is FedAvg's plain one."""
        together = batched_delta_updates(downlinks, jobs, trainer) if self.trains_clients_together(trainer) else (
            [None] * len(jobs))
        return [u if u is not None else self.client_update(d, j, trainer) for u, d, j in zip(together, downlinks, jobs)]

    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        c = self.config
        signs = [-1.0 if forgotten(u, c.forget_tasks or (), c.forget_clients or ()) else 1.0 for u in updates]
        negated = negate_forgotten(updates, c.forget_tasks or (), c.forget_clients or ())
        if self.lora_ranks:  # clients of different ranks: their products, re-factorized to the server's rank
            shared, diagnostics = mixed_rank_step(state.vectors[SHARED], updates, negated, self.lora_ranks,
                                                  state.round, c.server_lr, signs)
            new = state.next({SHARED: shared, **average_heads(state, negated, c.server_lr)})
            return AggregatedState(new.round, new.vectors, new.scalars, diagnostics=diagnostics)
        vectors = {SHARED: fedavg_shared(state, negated, c.server_lr), **average_heads(state, negated, c.server_lr)}
        if c.track_task_vectors:
            vectors.update(accumulate_task_vectors(state, negated, c.server_lr))
        vectors[SHARED], diagnostics = aggregate_lora(state.vectors[SHARED], updates, vectors[SHARED],
                                                      self.lora_aggregation, c.server_lr, signs)
        new = state.next(vectors)
        return AggregatedState(new.round, new.vectors, new.scalars, diagnostics=diagnostics)

    def check_private(self, config) -> None:
        c = self.config
        for name, on in (("forget_tasks", c.forget_tasks), ("forget_clients", c.forget_clients),
                         ("track_task_vectors", c.track_task_vectors)):
            if on:
                raise ConfigError(f"{name}: strategy {self.name!r} cannot combine it with client-level DP "
                                  "(it needs each client's individual update; DP releases only noisy sums)")
        if self.lora_aggregation == PRODUCT:
            raise ConfigError(f"lora_aggregation product: strategy {self.name!r} cannot combine it with client-level "
                              "DP (it multiplies each client's own LoRA factors; DP releases only noisy sums of "
                              "them): use lora_aggregation factors")

    def private_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        """Under client-level DP (`hf_fedtask.privacy`): the shared modules move by α times the plain mean of
        the clients' (clipped, noised) changes and each head by the plain mean over its holders (sample counts
        are 1 under DP), so both are noisy sums over fixed counts; the LoRA factor error, measured on
        individual uploads, is not released."""
        return state.next({SHARED: fedavg_shared(state, updates, self.config.server_lr, uniform=True),
                           **average_heads(state, updates, self.config.server_lr)})


def delta_update(downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer,
                 options: Callable[[str], dict] = lambda task: {}) -> ClientUpdate:
    """Train the client's tasks in turn (`train_tasks_in_turn`) and send the change of the shared
    modules and of each head."""
    return _delta(downlink, job, *train_tasks_in_turn(downlink, job, trainer, options=options))


def _delta(downlink: dict[str, TaskVector], job: ClientJob, shared: TaskVector, heads: dict[str, TaskVector],
           metrics: dict) -> ClientUpdate:
    """The update of trained `shared` modules and `heads`: their changes from the downlink."""
    vectors = {SHARED: shared - downlink[SHARED]}
    vectors.update({head_name(t): h - downlink[head_name(t)] for t, h in heads.items()})
    return ClientUpdate(job.client_id, job.round, vectors, job.num_samples(), metrics)


def _split_trained(downlink: dict[str, TaskVector], task: str, trained: TaskVector, m: dict
                   ) -> tuple[TaskVector, dict[str, TaskVector], dict]:
    """(shared modules, {task: head}, metrics) of a state trained on `task`."""
    shared = trained.filter(lambda k: k in downlink[SHARED])
    head = trained.filter(lambda k: k not in downlink[SHARED])
    return shared, {task: head}, {f"{task}/train_loss": m["train_loss"], f"{task}/lr_sum": m.get("lr_sum", 0.0)}


def batched_delta_updates(downlinks: list[dict[str, TaskVector]], jobs: list[ClientJob],
                          trainer: LocalTrainer) -> list[ClientUpdate | None]:
    """`delta_update` of the jobs (no extra training options) whose clients `trainer.train_many` trains together
    (one task, of one data size, per group); None for the others, which the caller trains one at a time."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, job in enumerate(jobs):
        if len(job.tasks) == 1:
            groups.setdefault((job.tasks[0], len(job.data[job.tasks[0]])), []).append(i)
    updates: list[ClientUpdate | None] = [None] * len(jobs)
    for (task, _), members in groups.items():
        starts = [TaskVector({**downlinks[i][SHARED], **downlinks[i][head_name(task)]}) for i in members]
        trained = trainer.train_many(starts, [jobs[i].data[task] for i in members],
                                     [jobs[i].seed_for(task) for i in members]) if len(members) > 1 else None
        for i, (state, m) in zip(members, trained or ()):
            updates[i] = _delta(downlinks[i], jobs[i], *_split_trained(downlinks[i], task, state, m))
    return updates


def forgotten(update: ClientUpdate, tasks: Iterable[str], clients: Iterable[int] = ()) -> bool:
    """Whether unlearning negates `update`: its client holds a task in `tasks` or is listed in `clients`."""
    return bool(set(tasks) & set(update.num_samples)) or update.client_id in set(clients)


def negate_forgotten(updates: list[ClientUpdate], tasks: Iterable[str],
                     clients: Iterable[int] = ()) -> list[ClientUpdate]:
    """Unlearning by negation: every vector of a client holding a task in `tasks`, or listed in
    `clients`, flips sign, so aggregation moves the model away from what its training would add."""
    tasks, clients = set(tasks), set(clients)
    return [dataclasses.replace(u, vectors={k: -v for k, v in u.vectors.items()})
            if forgotten(u, tasks, clients) else u for u in updates]


def aggregate_lora(shared: TaskVector, updates: list[ClientUpdate], averaged: TaskVector, mode: str,
                   server_lr: float = 1.0, signs: list[float] | None = None) -> tuple[TaskVector, dict]:
    """The LoRA pairs of the shared modules after a FedAvg step, and what the step measured. Each client's
    factors are rebuilt as the global ones (`shared`) plus its change in `updates` (as sent, σ_i = −1 in
    `signs` where unlearning negates it), weighted by its sample count. `mode` "factors": `averaged` (the
    factor means FedAvg computed) as it is, with `lora_factor_error`, ‖M − B̄·Ā‖_F / ‖M‖_F over all pairs
    together (M: the exact step of the products, `hf_fedtask.merge.lora_product.step_terms`). "product":
    each pair replaced by M re-factorized to the pair's rank (`product_step`), with
    `lora_truncation_residual`, ‖M − M_r‖_F / ‖M‖_F over all pairs. Keys other than LoRA factors keep
    `averaged`'s values. Clients and server share one rank and α here, so LoRA's scaling α/r is common to
    every term and cancels (scaling 1). Returns (`averaged` or its updated copy, {} for a state without
    LoRA factors in "factors" mode)."""
    try:
        pairs = lora_pairs(shared)
    except ValueError as e:
        raise ConfigError(f"LoRA aggregation: {e}") from None
    if not pairs:
        if mode == PRODUCT:
            raise ConfigError("lora_aggregation product: the shared modules hold no LoRA factors (lora_A/lora_B); "
                              "use lora_aggregation factors for this PEFT method")
        return averaged, {}
    weights = [u.total_samples for u in updates]
    out, error, total = dict(averaged), 0.0, 0.0
    for a_key, b_key in pairs:
        start = as_factors(shared[b_key], shared[a_key])
        clients = [as_factors(shared[b_key] + u.vectors[SHARED][b_key], shared[a_key] + u.vectors[SHARED][a_key])
                   for u in updates]
        if mode == PRODUCT:
            step = product_step(start, clients, weights, [1.0] * len(clients), rank=start[1].shape[0], scaling=1.0,
                                server_lr=server_lr, signs=signs)
            out[a_key], out[b_key] = step.A.reshape(shared[a_key].shape), step.B.reshape(shared[b_key].shape)
            error, total = error + step.discarded, total + step.total
        else:
            e, t = factor_step_error(start, clients, weights, as_factors(averaged[b_key], averaged[a_key]),
                                     server_lr=server_lr, signs=signs)
            error, total = error + e, total + t
    value = math.sqrt(error / total) if total > 0 else 0.0
    if mode == PRODUCT:
        return TaskVector(out), {"lora_truncation_residual": value}
    return averaged, {"lora_factor_error": value}


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
        shared, head, task_metrics = _split_trained(downlink, task, trained, m)
        heads.update(head)
        metrics.update(task_metrics)
    return shared, heads, metrics


@register_strategy
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"
    config_class = FedProxLoRAConfig

    def _train_options(self, downlink, job, task) -> dict:
        options = super()._train_options(downlink, job, task)
        return {**options, "objectives": [*options.get("objectives", []), ProximalTerm(self.config.proximal_mu)]}
