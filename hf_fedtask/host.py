"""One base model with one PEFT adapter in memory, shared by every simulated client.

Client state (PEFT parameters and per-task heads) lives outside the model as `TaskVector`s in
PEFT's saved naming and is swapped in with `load_state` before a client trains or a task is
evaluated. Simulating 1,000 clients therefore costs 1,000 small tensor dicts, never 1,000 models.
"""

from __future__ import annotations

import hashlib

import torch
import datasets
from datasets import Dataset
from peft import PeftConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.utils import ModulesToSaveWrapper

from .backbone import BaseModelRef, load_sequence_classifier, load_tokenizer
from .data.task import Task
from .taskvector import TaskVector


class PeftHost:
    """The single in-memory PEFT model, its tokenizer, and the split of its trainable parameters
    into *shared* PEFT-module keys and *head* keys (the per-task classification head)."""

    def __init__(
        self,
        base: BaseModelRef,
        peft_config: PeftConfig,
        *,
        seed: int = 0,
        max_length: int = 32,
        attn_implementation: str | None = None,
    ):
        self.base = base
        self.peft_config = peft_config
        self.max_length = max_length
        self.tokenizer = load_tokenizer(base)
        torch.manual_seed(seed)  # the PEFT init (e.g. LoRA A) is the shared, seeded starting point
        self.model = get_peft_model(load_sequence_classifier(base, 2, attn_implementation), peft_config)
        self._heads = [m for m in self.model.modules() if isinstance(m, ModulesToSaveWrapper)]
        if len(self._heads) != 1:
            raise ValueError(f"expected one classification head in modules_to_save, found {len(self._heads)}")
        head_names = set(self.model.modules_to_save or ())
        keys = list(get_peft_model_state_dict(self.model))
        self.head_keys = [k for k in keys if head_names & set(k.split("."))]
        self.shared_keys = [k for k in keys if k not in self.head_keys]
        self._keys = set(keys)

    # -- parameters as tensors -------------------------------------------------------------
    def state(self) -> TaskVector:
        """A detached copy of every trainable parameter (shared modules and the active head)."""
        sd = get_peft_model_state_dict(self.model)
        return TaskVector({k: v.detach().clone() for k, v in sd.items()})

    def load_state(self, state: TaskVector) -> None:
        """Copy `state` (shared keys + head keys, saved naming) into the model; resizes the head to
        the shape in `state`, so tasks with different label counts share one model."""
        self._resize_head(state[self.head_keys[0]].shape[0])
        unknown = [k for k in state if k not in self._keys]
        if unknown:
            raise KeyError(f"unexpected parameter {unknown[0]!r} for this PEFT model")
        set_peft_model_state_dict(self.model, dict(state))

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
        """The seeded PEFT-module init: the origin every task vector is measured from."""
        return self.state().filter(lambda k: k in self.shared_keys)

    def initial_head(self, num_labels: int, seed: int) -> TaskVector:
        """A fresh head for a task, initialised as the backbone's own classifier init would be."""
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
        """Token ids + `labels`, dropping every other column so Trainer and eval see model inputs only."""
        tokenizer, max_length = self.tokenizer, self.max_length

        def encode(batch):
            enc = tokenizer(batch[task.text_column], truncation=True, max_length=max_length)
            enc["labels"] = batch[task.label_column]
            return enc

        # An explicit fingerprint: otherwise `datasets` dill-hashes the tokenizer on every call (~1 s).
        fingerprint = hashlib.sha256(
            f"{dataset._fingerprint}|{tokenizer.name_or_path}|{len(tokenizer)}|{max_length}|{task.text_column}".encode()
        ).hexdigest()[:16]
        was_enabled = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # hundreds of tiny maps: one bar each would drown the run's own
        try:
            return dataset.map(encode, batched=True, remove_columns=dataset.column_names, keep_in_memory=True,
                               new_fingerprint=fingerprint)
        finally:
            if was_enabled:
                datasets.enable_progress_bars()
