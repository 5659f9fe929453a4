"""FedYolo (Zhang et al., 2023, arXiv:2307.04905, Alg. 1): one frozen backbone, one PEFT module and
one head per task.

Every task k owns W^k = (module, head), held on the host as its own named PEFT adapter
(`adapter_name(k)`). Each round the engine samples M clients; a client receives the modules and
heads of its tasks only, trains each task in turn with that task's adapter active, and sends the
changes. For every task k the server sets

    W^{t+1,k} = W^{t,k} + mean of the changes of the sampled clients holding k    (unweighted)

and tasks without a sampled holder keep W^k. `sample_weighted=True` weights the mean by sample
counts instead. Variants (`share`):

    none  every module per task (vanilla FedYolo)
    half  the modules in the first ⌊L/2⌋ transformer blocks are shared by all tasks and averaged over
          all sampled clients; later blocks and the heads stay per task
    all   every module shared, heads per task (modular FedAvg with the paper's unweighted mean;
          the `fedavg` strategy is the sample-weighted modular FedAvg baseline)

State: `shared` (the shared modules; absent with share="none"), `module/<task>` (absent with
share="all") and `head/<task>`.

Privacy variant (`secure_aggregation=True`): every client uploads a slot for each of the K tasks
(its own changes, zeros for the tasks it does not hold) and a count vector (1 for each task it
holds and for the shared part), masked by the engine with pairwise secure aggregation
(`hf_fedtask.engine.secure`). The server sees only the sum, so it learns neither a client's update
nor its tasks; each task's mean is its summed slot over its count. The upload grows from
module + head to K × (module + head) + K + 1 numbers.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from hf_fedtask.core.state import COUNTS, HEAD, MODULE, module_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError
from hf_fedtask.merge import weighted_average
from hf_fedtask.privacy.hooks import ClientPrivacy
from hf_fedtask.strategies.base import (
    SHARED,
    Capabilities,
    ClientJob,
    GlobalState,
    Strategy,
    configured_capabilities,
    head_name,
    register_strategy,
    updates_by_task,
)

# `NAME as NAME`: re-exported, defined here before hf_fedtask.strategies.configs
from hf_fedtask.strategies.configs import SHARE_MODES as SHARE_MODES
from hf_fedtask.strategies.configs import FedYoloConfig
from hf_fedtask.strategies.fedavg import train_tasks_in_turn

if TYPE_CHECKING:
    from datasets import Dataset

    from hf_fedtask.client.trainer import LocalTrainer

_BLOCK = re.compile(r"\.(?:layer|layers|h|blocks)\.(\d+)\.")


def adapter_name(task: str) -> str:
    """The host's PEFT adapter name for `task` (module names cannot hold dots)."""
    return "task_" + re.sub(r"[^0-9A-Za-z_-]", "_", task)


def block_index(key: str) -> int | None:
    """The transformer block a PEFT parameter sits in, from its saved name (`encoder.layer.3.` in
    BERT and ViT, `layers.3.` in ViT-style stacks), or None outside numbered blocks (prompts)."""
    m = _BLOCK.search(key)
    return int(m.group(1)) if m else None


def shared_module_keys(keys: list[str], share: str) -> list[str]:
    """The module keys `share` makes common to all tasks: none, all, or those in the first ⌊L/2⌋
    blocks, L counted from the keys (the highest block index + 1)."""
    if share == "none":
        return []
    if share == "all":
        return list(keys)
    blocks = {k: block_index(k) for k in keys}
    numbered = [i for i in blocks.values() if i is not None]
    if not numbered:
        raise ConfigError("fedyolo: share='half' needs PEFT modules inside numbered transformer blocks "
                          "(lora, ia3, bottleneck); these modules (e.g. prompt tuning) have none: use 'none' or 'all'")
    half = (max(numbered) + 1) // 2
    return [k for k, i in blocks.items() if i is not None and i < half]


class _TaskAdapters:
    """The local trainer as `train_tasks_in_turn` drives it, with `train(..., adapter=name)` run while
    the host's PEFT adapter `name` is active: each task trains in its own adapter."""

    def __init__(self, trainer: LocalTrainer):
        self.trainer = trainer

    def train(self, state: TaskVector, data: Dataset, *, adapter: str, **kwargs) -> tuple[TaskVector, dict]:
        with self.trainer.host.adapter(adapter):
            return self.trainer.train(state, data, **kwargs)


@register_strategy
class FedYolo(Strategy, ClientPrivacy):
    name = "fedyolo"
    paper = ("Zhang et al., FedYolo: Augmenting Federated Learning with Pretrained Transformers, "
             "arXiv 2307.04905, 2023")
    config_class = FedYoloConfig

    @configured_capabilities
    def capabilities(config: FedYoloConfig) -> Capabilities:
        """Secure aggregation is the privacy variant's (`secure_aggregation`)."""
        return Capabilities(secure_aggregation=config.secure_aggregation, exports=("adapters", "multi_adapter"),
                            client_dp=True)

    public_entries = (COUNTS,)  # the slot counts: 1 per task held (the public allocation) under DP

    def check_private(self, config) -> None:
        if self.config.sample_weighted:
            raise ConfigError("sample_weighted: strategy 'fedyolo' cannot weight by sample counts under client-level "
                              "DP (aggregation weights must not depend on the data: every holder weighs 1)")

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        modules = state.vectors.pop(SHARED)  # the seeded PEFT init: every task's module starts there
        shared = set(shared_module_keys(list(modules), self.config.share))
        if shared:
            state.vectors[SHARED] = modules.filter(lambda k: k in shared)
        own = modules.filter(lambda k: k not in shared)
        if own:
            state.vectors.update({module_name(t.name): own for t in tasks})
        return state

    def task_parameters(self, state, task, stores=None) -> TaskVector:
        """Task `task`'s full PEFT state: the shared modules, its own modules and its head."""
        parts = (state.vectors.get(SHARED), state.vectors.get(module_name(task)), state.vectors[head_name(task)])
        return TaskVector({k: v for part in parts if part for k, v in part.items()})

    def downlink(self, state, client_id, tasks) -> dict[str, TaskVector]:
        """The shared modules and the modules and heads of the client's tasks, never another task's."""
        out = _shared(state)
        out.update({module_name(t): state.vectors[module_name(t)] for t in tasks if module_name(t) in state.vectors})
        return {**out, **state.heads(tasks)}

    def update_templates(self, state, client_id, tasks) -> dict[str, TaskVector]:
        """The downlink's layout; with secure aggregation, the slot layout, the same for every client."""
        if not self.config.secure_aggregation:
            return super().update_templates(state, client_id, tasks)
        tasks = _tasks(state)
        templates = _shared(state)
        for t in tasks:
            templates.update({n: state.vectors[n] for n in (module_name(t), head_name(t)) if n in state.vectors})
        templates[COUNTS] = _counts(tasks, {}, SHARED in state.vectors, 0.0)
        return templates

    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        start = downlink.get(SHARED, TaskVector({}))
        local = {SHARED: start}
        local.update({head_name(t): TaskVector({**downlink.get(module_name(t), {}), **downlink[head_name(t)]})
                      for t in job.tasks})
        shared, trained, metrics = train_tasks_in_turn(local, job, _TaskAdapters(trainer),
                                                       options=lambda task: {"adapter": adapter_name(task)})
        vectors = {SHARED: shared - start} if SHARED in downlink else {}
        for t, tv in trained.items():  # tv: the task's own modules and head, trained
            for name in (module_name(t), head_name(t)):
                if name in downlink:
                    vectors[name] = TaskVector({k: v for k, v in tv.items() if k in downlink[name]}) - downlink[name]
        update = ClientUpdate(job.client_id, job.round, vectors, job.num_samples(), metrics)
        return self._slots(update, job) if self.config.secure_aggregation else update

    def _weight(self, update: ClientUpdate, task: str | None = None) -> float:
        """A client's weight in a task's mean (in the shared mean with `task=None`)."""
        if not self.config.sample_weighted:
            return 1.0
        return float(update.total_samples if task is None else update.num_samples[task])

    def _slots(self, update: ClientUpdate, job: ClientJob) -> ClientUpdate:
        """The privacy variant's upload: one weighted slot per task of the run (zeros for the tasks the
        client does not hold) and the count vector, so that sums over clients give every mean."""
        own = {t: self._weight(update, t) for t in update.num_samples}
        vectors = {SHARED: update.vectors[SHARED] * self._weight(update)} if SHARED in update.vectors else {}
        module_like = next((tv for n, tv in update.vectors.items() if n.startswith(MODULE)), None)
        for t in sorted(job.initial_heads):
            if module_like is not None:
                mod = module_name(t)
                vectors[mod] = update.vectors[mod] * own[t] if t in own else module_like.zeros_like()
            head = head_name(t)
            vectors[head] = update.vectors[head] * own[t] if t in own else job.initial_heads[t].zeros_like()
        vectors[COUNTS] = _counts(sorted(job.initial_heads), own, SHARED in update.vectors, self._weight(update))
        return ClientUpdate(update.client_id, update.round, vectors, update.num_samples, update.metrics)

    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        means = self._means_from_sum(state, updates) if self.config.secure_aggregation else self._means(updates)
        return state.next({name: state.vectors[name] + mean for name, mean in means.items()})

    def _means(self, updates: list[ClientUpdate]) -> dict[str, TaskVector]:
        """Alg. 1, lines 10–13: each task's mean change over its sampled holders; the shared part's
        over all sampled clients."""
        means = {}
        if SHARED in updates[0].vectors:
            means[SHARED] = weighted_average([u.vectors[SHARED] for u in updates], map(self._weight, updates))
        for task, holders in updates_by_task(updates).items():
            for name in (module_name(task), head_name(task)):
                if name in holders[0].vectors:
                    means[name] = weighted_average([u.vectors[name] for u in holders],
                                                   (self._weight(u, task) for u in holders))
        return means

    def _means_from_sum(self, state: GlobalState, updates: list[ClientUpdate]) -> dict[str, TaskVector]:
        """The same means from slot uploads: sum them (the secure engine passes their sum, already
        formed under masks) and divide each slot by its count; slots with count 0 give no mean."""
        total = {name: sum(u.vectors[name] for u in updates) for name in updates[0].vectors}
        counts = total.pop(COUNTS)
        means = {}
        if SHARED in counts:
            means[SHARED] = total[SHARED] / float(counts[SHARED][0])
        for task, count in zip(_tasks(state), counts["tasks"].tolist()):
            if count > 0:
                means.update({n: total[n] / count for n in (module_name(task), head_name(task)) if n in total})
        return means


def _shared(state: GlobalState) -> dict[str, TaskVector]:
    """`{"shared": ...}` when the variant shares modules, else empty."""
    return {SHARED: state.vectors[SHARED]} if SHARED in state.vectors else {}


def _tasks(state: GlobalState) -> list[str]:
    """The run's tasks (those with a head), in the order of the privacy variant's slots."""
    return sorted(name.removeprefix(HEAD) for name in state.vectors if name.startswith(HEAD))


def _counts(tasks: list[str], weights: dict[str, float], shared: bool, shared_weight: float) -> TaskVector:
    """The count vector of a slot upload: each task's weight (0 where not held), and the shared part's."""
    counts = {"tasks": torch.tensor([weights.get(t, 0.0) for t in tasks], dtype=torch.float32)}
    if shared:
        counts[SHARED] = torch.tensor([shared_weight], dtype=torch.float32)
    return TaskVector(counts)
