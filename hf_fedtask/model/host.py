"""One base model with one PEFT adapter in memory, shared by every simulated client.

Client state (PEFT parameters and per-task heads) lives outside the model as `TaskVector`s in
PEFT's saved naming and is swapped in with `load_state` before a client trains or a task is
evaluated. Simulating 1,000 clients therefore costs 1,000 small tensor dicts, never 1,000 models.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from datasets import Dataset
from peft import (
    PeftConfig,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from peft.utils import ModulesToSaveWrapper

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.data.task import Task
from hf_fedtask.errors import ConfigError
from hf_fedtask.model.backbone import BaseModelRef, load_classifier, load_inputs, quiet_peft_wrap
from hf_fedtask.model.device import autocast, check_mixed_precision, model_device, to_cpu
from hf_fedtask.model.linearize import LinearizedModel, linearized

HEAD_MODULES = frozenset({"classifier", "score"})
"""Names of the classification head: what PEFT's SEQ_CLS task type adds to `modules_to_save` and what
image models name. Other `modules_to_save` (e.g. the backbone for peft_method "full") are not head."""


class PeftHost:
    """The single in-memory PEFT model, its input preparer (`inputs`: tokenizer-based for text
    models, image-processor-based for vision models), and the split of its trainable parameters
    into *shared* PEFT-module keys and *head* keys (the per-task classification head). With
    `shared_head` > 0 (a shared output space, `hf_fedtask.model.output_space`) one head of that many
    outputs belongs to the shared state instead and tasks have no head of their own.

    The model starts with PEFT's "default" adapter; `adapter(name)` switches to another named one
    (same config, same saved keys), as FedYolo does with one adapter per task.

    The model lives on `device` (built on the CPU from the seed, then moved, so every device starts
    from the same init); `state()` always returns CPU tensors. `mixed_precision` is the autocast
    precision of training and of `autocast()`; `quantization` a transformers `BitsAndBytesConfig`
    (QLoRA: the base loaded quantized onto `device`, the PEFT parameters in fp32)."""

    def __init__(
        self,
        base: BaseModelRef,
        peft_config: PeftConfig,
        *,
        seed: int = 0,
        max_length: int = 32,
        attn_implementation: str | None = None,
        shared_head: int = 0,
        device: torch.device | str = "cpu",
        mixed_precision: str = "no",
        quantization=None,
    ):
        device = torch.device(device)
        check_mixed_precision(mixed_precision, device)
        self.mixed_precision = mixed_precision
        self.base = base
        self.seed = seed
        self.shared_head = shared_head
        self.peft_config = peft_config
        self.inputs = load_inputs(base, max_length)
        # the processor as loaded, for exports: tokenizing sets a fast tokenizer's truncation and padding state,
        # which `save_pretrained` writes into tokenizer.json (see `_loaded_config` below)
        self._loaded_processor = copy.deepcopy(self.inputs.processor)
        if peft_config.task_type != self.inputs.peft_head.get("task_type"):
            raise ConfigError(f"{base.model_id} takes {self.inputs.kind} inputs: build its PEFT config with "
                              f"make_peft_config(..., modality={self.inputs.kind!r})")
        torch.manual_seed(seed)  # the PEFT init (e.g. LoRA A) is the shared, seeded starting point
        try:
            classifier = load_classifier(base, 2, attn_implementation, quantization=quantization, device=device)
            with quiet_peft_wrap():
                self.model = get_peft_model(classifier, peft_config)
        except ValueError as e:  # e.g. target_modules missing, or naming no module of this architecture
            raise ConfigError(f"{base.model_id}: the PEFT config does not fit this model "
                              f"({str(e).splitlines()[0]})") from e
        # the config as loaded, for exports: training changes the live one (the Trainer sets `use_cache`), so an
        # export from the live config would depend on whether this process trained (in-process) or not (Flower)
        self._loaded_config = copy.deepcopy(classifier.config)
        if quantization is None:
            self.model.to(device)  # a quantized base was loaded onto the device; its PEFT layers follow it
        self._heads = [m for name, m in self.model.named_modules()
                       if isinstance(m, ModulesToSaveWrapper) and name.rpartition(".")[2] in HEAD_MODULES]
        if len(self._heads) != (0 if self.causal_lm else 1):  # a causal LM's own LM head answers, in words
            raise ValueError(f"expected one classification head in modules_to_save, found {len(self._heads)}")
        if self.causal_lm and shared_head:
            raise ConfigError("output_space: a causal LM answers every task in words (no classification head); "
                              "use output_space per_task")
        keys = list(get_peft_model_state_dict(self.model))
        self.head_keys = [k for k in keys if HEAD_MODULES & set(k.split("."))]
        self.shared_keys = [k for k in keys if k not in self.head_keys]
        self._keys = set(keys)

    @property
    def causal_lm(self) -> bool:
        """Whether the base is a causal LM answering instructions (no classification head: tasks'
        heads are empty and every trainable parameter is a shared PEFT module)."""
        return self.inputs.kind == "causal_lm"

    @property
    def device(self) -> torch.device:
        """Where the model computes: every batch goes here."""
        return model_device(self.model)

    def autocast(self):
        """The context evaluation runs the model in: autocast to the training's mixed precision."""
        return autocast(self.device, self.mixed_precision)

    def classifier_config(self):
        """A copy of the classification model's transformers config as loaded (not as training left it), naming
        its class in `architectures` (a checkpoint may name only its backbone, e.g. BertModel)."""
        classifier = self.model.get_base_model()
        config = copy.deepcopy(self._loaded_config)
        config.architectures = [type(classifier).__name__]
        if hasattr(config, "quantization_config"):  # a QLoRA run's base: exports describe the unquantized one
            del config.quantization_config
        return config

    def export_processor(self):
        """A copy of the tokenizer or image processor as loaded (not as tokenizing left it), for exports."""
        return copy.deepcopy(self._loaded_processor)

    # -- parameters as tensors -------------------------------------------------------------
    def state(self) -> TaskVector:
        """A detached CPU copy of every trainable parameter of the active adapter (shared modules and head)."""
        sd = get_peft_model_state_dict(self.model, adapter_name=self.model.active_adapter)
        return TaskVector({k: to_cpu(v) for k, v in sd.items()})

    def state_keys(self) -> list[str]:
        """The saved names `state()` returns, in its order, without copying any tensor."""
        return list(get_peft_model_state_dict(self.model, adapter_name=self.model.active_adapter))

    def load_state(self, state: TaskVector) -> None:
        """Copy `state` (shared keys + head keys, saved naming) into the active adapter; resizes its
        head to the shape in `state`, so tasks with different label counts share one model."""
        if self.head_keys:
            self._resize_head(state[self.head_keys[0]].shape[0])
        unknown = [k for k in state if k not in self._keys]
        if unknown:
            raise KeyError(f"unexpected parameter {unknown[0]!r} for this PEFT model")
        set_peft_model_state_dict(self.model, dict(state), adapter_name=self.model.active_adapter)

    def trainable_by_name(self) -> dict[str, torch.nn.Parameter]:
        """The live trainable parameters of the active adapter, by PEFT saved name (as in `state`)."""
        saved = get_peft_model_state_dict(self.model, adapter_name=self.model.active_adapter)
        by_storage = {v.data_ptr(): k for k, v in saved.items()}
        return {by_storage[p.data_ptr()]: p for p in self.model.parameters()
                if p.requires_grad and p.data_ptr() in by_storage}

    @contextlib.contextmanager
    def adapter(self, name: str, peft_config: PeftConfig | None = None) -> Iterator[None]:
        """Make the PEFT adapter `name` active (`state`, `load_state`, training and inference then use
        it), adding it on first use with the host's config, or `peft_config` (e.g. the host's LoRA at
        another rank: a client of a mixed-rank run); the previous adapter is active again on exit. The new
        adapter's random init is drawn outside the global RNG stream and is meant to be overwritten with
        `load_state`."""
        previous = self.model.active_adapter
        if name not in self.model.peft_config:
            with torch.random.fork_rng(devices=[]):
                # a copy: PEFT appends its head names to the config's modules_to_save when adding
                self.model.add_adapter(name, copy.deepcopy(peft_config or self.peft_config))
        self.model.set_adapter(name)
        try:
            yield
        finally:
            self.model.set_adapter(previous)

    @contextlib.contextmanager
    def loaded(self, state: TaskVector, linearize_at: TaskVector | None = None,
               linearization: str = "network") -> Iterator[torch.nn.Module | LinearizedModel]:
        """The model carrying `state`: the host model itself, or, given `linearize_at` (a state of the
        same layout), the host model linearized around that point (`hf_fedtask.model.linearize`, mode
        `linearization`) and moved to `state`; the host model is restored on exit."""
        if linearize_at is None:
            self.load_state(state)
            yield self.model
            return
        self.load_state(linearize_at)  # the wrapper takes the live parameters as its point
        with linearized(self.model, mode=linearization) as lin:
            self.load_state(state)
            yield lin

    def _resize_head(self, num_labels: int) -> None:
        linear = self._heads[0].modules_to_save[self._heads[0].active_adapter]
        if linear.out_features != num_labels:
            linear.weight = torch.nn.Parameter(linear.weight.new_zeros(num_labels, linear.in_features))
            if linear.bias is not None:
                linear.bias = torch.nn.Parameter(linear.bias.new_zeros(num_labels))
            linear.out_features = num_labels
        inner = self.model.get_base_model()
        inner.num_labels = num_labels
        inner.config.num_labels = num_labels

    def initial_shared(self) -> TaskVector:
        """The seeded PEFT-module init (with the shared head, if any): the origin every task vector is
        measured from."""
        modules = self.state().filter(lambda k: k in self.shared_keys)
        if not self.shared_head:
            return modules
        return TaskVector({**modules, **self._fresh_head(self.shared_head, seed=self.seed * 1000 + 999)})

    def initial_head(self, num_labels: int, seed: int) -> TaskVector:
        """A fresh head for a task, initialised as the backbone's own classifier init would be; empty
        when the head is shared (it is part of `initial_shared`) and for a causal LM (none)."""
        return TaskVector({}) if self.shared_head or not self.head_keys else self._fresh_head(num_labels, seed)

    def _fresh_head(self, num_labels: int, seed: int) -> TaskVector:
        in_features = self._heads[0].modules_to_save[self._heads[0].active_adapter].in_features
        std = getattr(self.model.get_base_model().config, "initializer_range", 0.02)
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for key in self.head_keys:
            if key.endswith("weight"):
                tensors[key] = torch.randn(num_labels, in_features, generator=gen) * std
            else:
                tensors[key] = torch.zeros(num_labels)
        return TaskVector(tensors)

    # -- data --------------------------------------------------------------------------------
    def tokenize(self, dataset: Dataset, task: Task) -> Dataset:
        """Model inputs + `labels`, every other column dropped so Trainer and eval see model inputs
        only: token ids for text tasks, `pixel_values` for image tasks (the name predates images)."""
        if task.modality != self.inputs.modality:
            raise ConfigError(f"task {task.name!r} has {task.modality} inputs but base model {self.base.model_id} "
                              f"takes {self.inputs.modality}")
        return self.inputs.prepare(dataset, task)
