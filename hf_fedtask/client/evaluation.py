"""Evaluation of one task's parameters on its test split, on the shared host model."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from hf_fedtask.client.lean import PreparedData
from hf_fedtask.core.progress import PROGRESS_DELAY, progress_bar
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import ConfigError
from hf_fedtask.metrics import FREE_TEXT_METRICS, check_metric, compute, free_text_scores
from hf_fedtask.model.device import to_device
from hf_fedtask.model.host import PeftHost


def _bar(progress, total: int):
    """(bar, owned): a delayed bar over `total` examples named `progress` (owned: closed by the caller), the
    caller's own bar to advance (a phase scoring several splits on one bar), or a disabled one for None."""
    if progress is None or isinstance(progress, str):
        # PROGRESS_DELAY read here, at call time: tests set it to 0 on this module to see a bar at once
        return progress_bar(total=total, desc=progress, unit="ex", delay=PROGRESS_DELAY,
                            disable=progress is None), True
    return progress, False


@torch.no_grad()
def predict_batches(model, inputs, data: Dataset, batch_size: int, device, *, autocast=contextlib.nullcontext,
                    progress=None) -> np.ndarray:
    """`model`'s label for each example of prepared `data` (the classifier's argmax, or a causal LM's choice
    of highest log-likelihood: `inputs.predict_batch`), batches moved to `device` and run under
    `autocast()`; the predictions come back to the CPU. `progress`: the description of a tqdm bar over the
    examples on stderr (shown after PROGRESS_DELAY seconds), a bar to advance by the examples scored (one
    bar over several splits), or None for none."""
    model.eval()
    prepared = _prepared(data, inputs.eval_collator, device)
    bar, owned = _bar(progress, len(data))
    preds = []
    with autocast(), (bar if owned else contextlib.nullcontext()):
        for start in range(0, len(data), batch_size):
            batch = prepared.batch(list(range(start, min(start + batch_size, len(data)))))
            preds.append(inputs.predict_batch(model, to_device(batch, device)).cpu())
            bar.update(len(preds[-1]))
    return torch.cat(preds).numpy() if preds else np.zeros(0, dtype=np.int64)


_PREPARED: OrderedDict[tuple, PreparedData] = OrderedDict()
PREPARED_SPLITS = 8
"""Test splits kept collated (`PreparedData`) between evaluations: a simulation scores the same splits every
round, and reading and collating their Arrow rows per batch was most of a small model's evaluation."""


def _prepared(data: Dataset, collator, device) -> PreparedData:
    key = (getattr(data, "_fingerprint", None) or id(data), len(data), id(collator), str(device))
    if key not in _PREPARED:
        _PREPARED[key] = PreparedData(data, collator, torch.device(device), budget_bytes=1 << 30)
        while len(_PREPARED) > PREPARED_SPLITS:
            _PREPARED.popitem(last=False)
    _PREPARED.move_to_end(key)
    return _PREPARED[key]


def _predict_with(model, host: PeftHost, data: Dataset, batch_size: int, progress=None) -> np.ndarray:
    """`predict_batches` on the host model's device, in the training's precision."""
    return predict_batches(model, host.inputs, data, batch_size, host.device, autocast=host.autocast,
                           progress=progress)


def predict(host: PeftHost, state: TaskVector, data: Dataset, batch_size: int = 128,
            linearize_at: TaskVector | None = None, linearization: str = "network", *, progress=None) -> np.ndarray:
    """Argmax predictions of the host model carrying `state` on prepared `data` (`host.tokenize`);
    with `linearize_at`, of the model linearized around that point (`hf_fedtask.model.linearize`).
    `progress`: as `predict_batches`'."""
    with host.loaded(state, linearize_at, linearization) as model:
        return _predict_with(model, host, data, batch_size, progress)


def evaluate(host: PeftHost, state: TaskVector, data: Dataset, metric: str = "accuracy", batch_size: int = 128,
             linearize_at: TaskVector | None = None, linearization: str = "network") -> dict:
    """`{metric: value, "num_examples": n}` for prepared `data` (which has a `labels` column)."""
    check_metric(metric)  # an unknown metric fails before any prediction
    return score(predict(host, state, data, batch_size, linearize_at, linearization), data, metric)


def generation_exact_match(host: PeftHost, state: TaskVector, data: Dataset, label_names,
                           batch_size: int = 128, *, progress=None) -> float:
    """A causal LM's greedy answers to `data`'s prompts against each example's label word, scored by
    the `exact_match` evaluate module (`hf_fedtask.metrics`); generation stops after the longest word.
    `progress`: as `predict_batches`' (greedy decoding is the slowest scoring there is)."""
    from hf_fedtask.model.instructions import label_words

    if not label_names:
        raise ConfigError("generation_exact_match: exact match scores answers against label words; a free-text "
                          "task has none (generation_rouge_l scores its responses)")
    words = label_words(label_names)
    longest = max(len(ids) for ids in host.inputs.choice_ids(words))
    answers = _greedy_answers(host, state, data, batch_size, longest + 1, progress)
    return compute("exact_match", [words[y] for y in labels_of(data)], answers)


def generation_rouge_l(host: PeftHost, state: TaskVector, data: Dataset, references, batch_size: int = 128, *,
                       progress=None) -> float:
    """A causal LM's greedy responses to a free-text task's prompts (`data`, prepared) against its reference
    responses (`references`, in `data`'s order), scored by ROUGE-L F-measure through the `rougeL` evaluate
    module (`hf_fedtask.metrics`); generation stops at the end of turn or after the longest reference's
    tokens. `progress`: as `predict_batches`'."""
    longest = max(data.with_format("numpy", columns=["answer_length"])[:]["answer_length"], default=1)
    responses = _greedy_answers(host, state, data, batch_size, int(longest), progress)
    return compute("rougeL", list(references), responses)


def _greedy_answers(host: PeftHost, state: TaskVector, data: Dataset, batch_size: int, max_new_tokens: int,
                    progress) -> list[str]:
    """Greedy answers of the host model carrying `state` to `data`'s prompts (left-padded, prompts only)."""
    from hf_fedtask.model.instructions import generate_answers

    prompts = host.inputs.eval_collator.prompts
    loader = DataLoader(data, batch_size=batch_size, collate_fn=prompts)
    answers = []
    bar, owned = _bar(progress, len(data))
    with host.loaded(state) as model, host.autocast(), (bar if owned else contextlib.nullcontext()):
        model.eval()
        for batch in loader:
            answers += generate_answers(model, host.inputs.processor, to_device(batch, host.device), max_new_tokens)
            bar.update(len(batch["input_ids"]))
    return answers


def score(preds: np.ndarray, data: Dataset, metric: str = "accuracy") -> dict:
    """`{metric: value, "num_examples": n}` of predictions against `data`'s `labels`, computed by the
    metric's `evaluate` module (`hf_fedtask.metrics`); for a free-text metric, from the predictions' answer
    statistics, with `answer_loss` beside it."""
    if metric in FREE_TEXT_METRICS:
        return {**free_text_scores(preds), "num_examples": len(data)}
    labels = labels_of(data)
    return {metric: compute(metric, labels, preds), "num_examples": len(labels)}


def labels_of(data: Dataset) -> np.ndarray:
    """`data`'s `labels` column as one array, read in one Arrow batch (`np.asarray(data["labels"])` formats it
    row by row: 0.14 s for 1,000 image rows against 4 ms)."""
    return data.with_format("numpy", columns=["labels"])[:]["labels"]
