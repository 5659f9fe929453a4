"""Evaluation of one task's parameters on its test split, on the shared host model."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.metrics import compute, module_path
from hf_fedtask.model.device import to_device
from hf_fedtask.model.host import PeftHost

PROGRESS_DELAY = 2.0
"""Seconds a scoring pass with a progress bar runs before the bar appears (tqdm's `delay`): quick ones stay
quiet, and anything slower (a causal LM, a large split) shows its progress, as training does."""


@torch.no_grad()
def predict_batches(model, inputs, data: Dataset, batch_size: int, device, *, autocast=contextlib.nullcontext,
                    progress: str | None = None) -> np.ndarray:
    """`model`'s label for each example of prepared `data` (the classifier's argmax, or a causal LM's choice
    of highest log-likelihood: `inputs.predict_batch`), batches moved to `device` and run under
    `autocast()`; the predictions come back to the CPU. `progress`: the description of a tqdm bar over the
    examples on stderr (shown after PROGRESS_DELAY seconds), or None for none."""
    model.eval()
    loader = DataLoader(data, batch_size=batch_size, collate_fn=inputs.eval_collator)
    bar = tqdm(total=len(data), desc=progress, unit="ex", delay=PROGRESS_DELAY, dynamic_ncols=True,
               disable=progress is None)
    preds = []
    with autocast(), bar:
        for batch in loader:
            preds.append(inputs.predict_batch(model, to_device(batch, device)).cpu())
            bar.update(len(preds[-1]))
    return torch.cat(preds).numpy() if preds else np.zeros(0, dtype=np.int64)


def _predict_with(model, host: PeftHost, data: Dataset, batch_size: int) -> np.ndarray:
    """`predict_batches` on the host model's device, in the training's precision."""
    return predict_batches(model, host.inputs, data, batch_size, host.device, autocast=host.autocast)


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


def generation_exact_match(host: PeftHost, state: TaskVector, data: Dataset, label_names,
                           batch_size: int = 128) -> float:
    """A causal LM's greedy answers to `data`'s prompts against each example's label word, scored by
    the `exact_match` evaluate module (`hf_fedtask.metrics`); generation stops after the longest word."""
    from hf_fedtask.model.instructions import generate_answers, label_words

    words = label_words(label_names)
    longest = max(len(ids) for ids in host.inputs.choice_ids(words))
    loader = DataLoader(data, batch_size=batch_size, collate_fn=host.inputs.eval_collator)
    answers = []
    with host.loaded(state) as model, host.autocast():
        model.eval()
        for batch in loader:
            answers += generate_answers(model, host.inputs.processor, to_device(batch, host.device), longest + 1)
    return compute("exact_match", [words[y] for y in data["labels"]], answers)


def score(preds: np.ndarray, data: Dataset, metric: str = "accuracy") -> dict:
    """`{metric: value, "num_examples": n}` of predictions against `data`'s `labels`, computed by the
    metric's `evaluate` module (`hf_fedtask.metrics`)."""
    labels = np.asarray(data["labels"])
    return {metric: compute(metric, labels, preds), "num_examples": len(labels)}
