"""Evaluation of one task's parameters on its test split, on the shared host model."""

from __future__ import annotations

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.metrics import compute, module_path
from hf_fedtask.model.device import to_device
from hf_fedtask.model.host import PeftHost


@torch.no_grad()
def _predict_with(model, host: PeftHost, data: Dataset, batch_size: int) -> np.ndarray:
    """Argmax of `model` on `data`'s batches, moved to the model's device and run in the training's
    precision; the predictions come back to the CPU."""
    model.eval()
    device = host.device
    loader = DataLoader(data, batch_size=batch_size, collate_fn=host.inputs.collator)
    with host.autocast():
        preds = [model(**to_device({k: v for k, v in batch.items() if k != "labels"}, device)).logits.argmax(-1).cpu()
                 for batch in loader]
    return torch.cat(preds).numpy()


def predict(host: PeftHost, state: TaskVector, data: Dataset, batch_size: int = 128,
            linearize_at: TaskVector | None = None, linearization: str = "network") -> np.ndarray:
    """Argmax predictions of the host model carrying `state` on prepared `data` (`host.tokenize`);
    with `linearize_at`, of the model linearized around that point (`hf_fedtask.model.linearize`)."""
    with host.loaded(state, linearize_at, linearization) as model:
        return _predict_with(model, host, data, batch_size)


def evaluate(host: PeftHost, state: TaskVector, data: Dataset, metric: str = "accuracy", batch_size: int = 128,
             linearize_at: TaskVector | None = None, linearization: str = "network") -> dict:
    """`{metric: value, "num_examples": n}` for prepared `data` (which has a `labels` column)."""
    module_path(metric)  # an unknown metric fails before any prediction
    return score(predict(host, state, data, batch_size, linearize_at, linearization), data, metric)


def score(preds: np.ndarray, data: Dataset, metric: str = "accuracy") -> dict:
    """`{metric: value, "num_examples": n}` of predictions against `data`'s `labels`, computed by the
    metric's `evaluate` module (`hf_fedtask.metrics`)."""
    labels = np.asarray(data["labels"])
    return {metric: compute(metric, labels, preds), "num_examples": len(labels)}
