"""What a process needs to act for a run, built from the `RunConfig` alone: the strategy, the loaded
tasks, the one host model, the local trainer and the seeded federation partition.

Each part is built on first use, so an export builds the host model but never tokenizes data, and a
client tokenizes only its own partition. One environment serves every client an in-process engine
simulates (one model in memory) and the server beside them; a Flower client process builds its own
from the same config and gets the same partition, the same seeded PEFT init and the same heads.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import numpy as np
from datasets import Dataset, DatasetDict

from hf_fedtask.client.trainer import LocalTrainer, LocalTrainingArgs
from hf_fedtask.config import RunConfig
from hf_fedtask.core.config_hash import peft_config_hash
from hf_fedtask.core.state import SHARED, GlobalState, head_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.data import build_federation, load_suite, load_task
from hf_fedtask.data.backdoor import backdoor_test_set, poisoned
from hf_fedtask.data.task import Task, TaskInfo
from hf_fedtask.errors import ConfigError
from hf_fedtask.model.backbone import BaseModelRef, classifier_class, input_kind, resolve_base_model
from hf_fedtask.model.device import resolve_device
from hf_fedtask.model.host import PeftHost
from hf_fedtask.model.output_space import OutputSpace
from hf_fedtask.model.peft_methods import make_peft_config
from hf_fedtask.model.quantization import quantization_config
from hf_fedtask.strategies import Strategy, build_strategy


def load_tasks(config: RunConfig) -> list[Task]:
    if config.tasks:
        tasks = [load_task(ref, seed=config.seed, builtin_train_size=config.builtin_train_size) for ref in config.tasks]
    else:
        tasks = load_suite(config.suite, seed=config.seed, train_size=config.builtin_train_size)
    if config.max_train_samples:
        for t in tasks:
            n = min(config.max_train_samples, len(t.dataset["train"]))
            t.dataset["train"] = t.dataset["train"].shuffle(seed=config.seed).select(range(n))
    if config.max_test_samples:
        for t in tasks:
            n = min(config.max_test_samples, len(t.dataset["test"]))
            t.dataset["test"] = t.dataset["test"].shuffle(seed=config.seed).select(range(n))
    return tasks


def build_host(config: RunConfig, shared_head: int = 0) -> PeftHost:
    """The one in-memory PEFT model a run uses, from the config's model keys; the base model's
    architecture decides the modality (text or image) and so the PEFT head settings. `shared_head`:
    the outputs of a head shared by all tasks (0: one head per task)."""
    base = resolve_base_model(config.base_model, config.base_model_id)
    peft_config = make_peft_config(
        config.peft_method,
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules,
        num_virtual_tokens=config.num_virtual_tokens,
        modality=input_kind(base).kind,
        backbone=backbone_name(base) if config.peft_method == "full" else None,
    )
    device = resolve_device(config.device)
    quantization = quantization_config(config.load_in_4bit, config.load_in_8bit, peft_method=config.peft_method,
                                       device=device, mixed_precision=config.mixed_precision,
                                       quant_type=config.bnb_4bit_quant_type,
                                       double_quant=config.bnb_4bit_use_double_quant)
    return PeftHost(base, peft_config, seed=config.seed, max_length=config.max_length, shared_head=shared_head,
                    device=device, mixed_precision=config.mixed_precision, quantization=quantization)


def backbone_name(base: BaseModelRef) -> str:
    """The classifier's attribute holding the pretrained trunk (`bert`, `vit`, ...), from its class."""
    return classifier_class(base).base_model_prefix


def build_trainer(host: PeftHost, config: RunConfig) -> LocalTrainer:
    """The local trainer with the config's local-training settings."""
    return LocalTrainer(host, LocalTrainingArgs.from_run(config))


class Environment:
    """The run's parts in this process, each built on first use from `config`."""

    def __init__(self, config: RunConfig, strategy: Strategy | None = None, tasks: list[TaskInfo] | None = None):
        self.config = config
        self.strategy = strategy or build_strategy(config.strategy, config.strategy_options)
        self._client_data: dict[int, dict[str, Dataset]] = {}
        self._test_data: dict = {}  # task -> test split; (kind, task) -> held-out / triggered sets
        if tasks is not None:  # a finished run's tasks without their data: nothing to train or evaluate
            self.__dict__["tasks"] = list(tasks)

    @cached_property
    def tasks(self) -> list[Task]:
        return load_tasks(self.config)

    @cached_property
    def task_by_name(self) -> dict[str, Task]:
        return {t.name: t for t in self.tasks}

    @cached_property
    def output_space(self) -> OutputSpace:
        """Where each task's labels live in the classification head (`config.output_space`)."""
        return OutputSpace.build(self.config.output_space, self.tasks)

    @cached_property
    def host(self) -> PeftHost:
        host = build_host(self.config, shared_head=self.output_space.width)
        refusal = self.strategy.capabilities.classifier_only
        if host.causal_lm and refusal:
            raise ConfigError(f"strategy {self.strategy.name!r} does not run on the causal LM "
                              f"{self.config.base_model}: {refusal}")
        return host

    def task_view(self, params: TaskVector, task: str) -> TaskVector:
        """A task's parameters as its own classifier: under a shared output space, the head cut to
        the task's rows (what is evaluated and exported); unchanged otherwise."""
        return self.output_space.task_view(params, task, self.host.head_keys)

    @cached_property
    def trainer(self) -> LocalTrainer:
        return build_trainer(self.host, self.config)

    @cached_property
    def held_out(self) -> dict[str, Dataset]:
        """The server's own slice of each task's training split (the strategy's `server_fraction`, a
        seeded choice; empty for most strategies): never partitioned among clients."""
        return self._training_splits[1]

    @cached_property
    def _training_splits(self) -> tuple[list[Task], dict[str, Dataset]]:
        fraction = self.strategy.server_fraction
        if fraction <= 0:
            return self.tasks, {}
        client_tasks, held = [], {}
        for i, task in enumerate(self.tasks):
            train = task.dataset["train"]
            order = np.random.default_rng([self.config.seed, i, 7]).permutation(len(train))
            cut = int(np.ceil(fraction * len(train)))
            held[task.name] = train.select(np.sort(order[:cut]))
            rest = DatasetDict({**task.dataset, "train": train.select(np.sort(order[cut:]))})
            client_tasks.append(dataclasses.replace(task, dataset=rest))
        return client_tasks, held

    @cached_property
    def partition(self) -> list[dict[str, Dataset]]:
        """Every client's raw train data per task (the seeded partitioner: the same in every process);
        the backdoored client's (`backdoor_client`) carry the trigger and the target label. The client
        ids the config names were checked against `client_count` when it was built."""
        c = self.config
        clients = build_federation(self._training_splits[0], c.client_count, zeta=c.zeta,
                                   partition=c.partition, alpha=c.alpha, classes_per_client=c.classes_per_client,
                                   seed=c.seed, min_samples=c.min_samples)
        if c.backdoor_client >= 0:
            for name, data in clients[c.backdoor_client].items():
                task = self.task_by_name[name]
                if task.free_text:
                    raise ConfigError(f"backdoor_client: a backdoor flips labels; task {name!r} answers in free text")
                if c.backdoor_target >= task.num_labels:
                    raise ConfigError(f"backdoor_target {c.backdoor_target} is not a class of task {name!r} "
                                      f"({task.num_labels} classes)")
                clients[c.backdoor_client][name] = poisoned(data, task, c.backdoor_trigger, c.backdoor_target)
        return clients

    @property
    def num_clients(self) -> int:
        return len(self.partition)

    @cached_property
    def allocation(self) -> dict[int, list[str]]:
        """A(n, t): client id -> the tasks it holds."""
        return {cid: sorted(data) for cid, data in enumerate(self.partition)}

    def client_data(self, client_id: int) -> dict[str, Dataset]:
        """Client `client_id`'s own train data, prepared for the model (tokenized once, then cached)."""
        if not 0 <= client_id < self.num_clients:
            raise ConfigError(f"client id {client_id} is outside this run's {self.num_clients} clients")
        if client_id not in self._client_data:
            self._client_data[client_id] = {name: self._training_data(ds, name)
                                            for name, ds in self.partition[client_id].items()}
        return self._client_data[client_id]

    def test_data(self, task: str) -> Dataset:
        """Task `task`'s test split, prepared for the model (cached)."""
        if task not in self._test_data:
            t = self.task_by_name[task]
            self._test_data[task] = self.host.tokenize(t.dataset["test"], t)
        return self._test_data[task]

    def server_data(self, task: str) -> Dataset:
        """The server's held-out slice of `task`'s training split, prepared for the model (cached)."""
        key = ("server", task)
        if key not in self._test_data:
            if task not in self.held_out:
                raise ConfigError(f"the server holds no data of task {task!r} (strategy {self.strategy.name!r})")
            self._test_data[key] = self._training_data(self.held_out[task], task)
        return self._test_data[key]

    def _training_data(self, raw: Dataset, task: str) -> Dataset:
        """Raw training data of `task` prepared for the model, its labels on the task's head rows."""
        return self.output_space.train_labels(self.host.tokenize(raw, self.task_by_name[task]), task)

    @property
    def backdoor_tasks(self) -> list[str]:
        """The tasks the backdoored client holds (none without a backdoor)."""
        b = self.config.backdoor_client
        return sorted(self.partition[b]) if b >= 0 else []

    def backdoor_test_data(self, task: str) -> Dataset:
        """`task`'s triggered test inputs of the classes other than the target, prepared (cached)."""
        key = ("backdoor", task)
        if key not in self._test_data:
            t, c = self.task_by_name[task], self.config
            raw = backdoor_test_set(t.dataset["test"], t, c.backdoor_trigger, c.backdoor_target)
            self._test_data[key] = self.host.tokenize(raw, t)
        return self._test_data[key]

    @cached_property
    def peft_hash(self) -> str:
        return peft_config_hash(self.host.model.peft_config["default"])

    def header(self) -> dict:
        """Header fields every update must carry: the base model and PEFT config it was trained for."""
        base = self.host.base
        return {"base_model": base.model_id, "base_model_revision": base.revision, "peft_config_hash": self.peft_hash}

    def initial_state(self, allocation: dict[int, list[str]] | None = None) -> GlobalState:
        """The strategy's state before any training: the seeded PEFT init θ_p and heads."""
        return self.strategy.init_state(self.host, self.tasks, self.config.seed,
                                        self.allocation if allocation is None else allocation)

    @cached_property
    def initial(self) -> GlobalState:
        """The initial state of this environment's allocation (built once; do not modify)."""
        return self.initial_state()

    @property
    def origin(self) -> TaskVector | None:
        """The seeded PEFT init every task vector is measured from; None when no module is shared."""
        return self.initial.vectors.get(SHARED)

    @property
    def initial_heads(self) -> dict[str, TaskVector]:
        return {t.name: self.initial.vectors[head_name(t.name)] for t in self.tasks}
