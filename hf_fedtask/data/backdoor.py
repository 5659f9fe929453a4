"""The backdoor protocol of F²L² (Jin et al., 2023) and the unlearning literature it follows: one
client's training data all carry a trigger and the target label, and the backdoor success rate (BSR)
is the share of triggered test inputs of the other classes that the model puts in the target class.

Triggers: for image tasks a white square of `size` pixels at the bottom right (MNIST 5×5, FMNIST
7×7 in the paper's code); for text tasks `size` copies of the rare token "cf" appended (the usual
textual trigger, Kurita et al., 2020).
"""

from __future__ import annotations

import numpy as np
from datasets import Dataset
from PIL import Image

from hf_fedtask.data.task import Task

TEXT_TRIGGER = "cf"
METRIC = "backdoor_success_rate"
"""Where evaluation reports the BSR, beside each backdoored task's own metric."""
GOAL_TA, GOAL_BSR = 1.0, 2.0
"""Points: how close a removal must come to retraining, in clean accuracy (TA) and BSR."""


def add_trigger_to_image(image: Image.Image, size: int) -> Image.Image:
    """`image` with its bottom-right `size` × `size` pixels set to white (in its own mode)."""
    pixels = np.array(image)
    white = np.iinfo(pixels.dtype).max if np.issubdtype(pixels.dtype, np.integer) else 1.0
    pixels[-size:, -size:, ...] = white
    return Image.fromarray(pixels)


def add_trigger_to_text(text: str, size: int) -> str:
    return text + "".join(f" {TEXT_TRIGGER}" for _ in range(size))


def triggered(data: Dataset, task: Task, size: int) -> Dataset:
    """`data` (raw, the task's columns) with the trigger added to every input."""
    column = task.text_column
    if task.modality == "image":
        return data.map(lambda row: {column: add_trigger_to_image(row[column], size)})
    return data.map(lambda row: {column: add_trigger_to_text(row[column], size)})


def poisoned(data: Dataset, task: Task, size: int, target: int) -> Dataset:
    """The backdoored client's training data: every input triggered, every label `target`."""
    out = triggered(data, task, size)
    return out.map(lambda row: {task.label_column: target})


def backdoor_test_set(data: Dataset, task: Task, size: int, target: int) -> Dataset:
    """The triggered test inputs whose true class is not `target` (their labels kept): the model's
    share of `target` predictions on them is the backdoor success rate."""
    keep = [i for i, y in enumerate(data[task.label_column]) if y != target]
    return triggered(data.select(keep), task, size)


def success_rate(predictions: np.ndarray, target: int) -> float:
    """The share of predictions equal to `target`."""
    return float(np.mean(np.asarray(predictions) == target)) if len(predictions) else 0.0


EDGE = 1e-9  # rates are counts over n: a gap on the window's edge (0.84 − 0.85) is inside it, float error aside


def within_goal(row: dict, reference: dict) -> bool:
    """|ΔTA| ≤ `GOAL_TA` and |ΔBSR| ≤ `GOAL_BSR` points between two evaluations (`ta`, `bsr`: fractions),
    a removal and a retraining."""
    return (abs(100 * (row["ta"] - reference["ta"])) <= GOAL_TA + EDGE
            and abs(100 * (row["bsr"] - reference["bsr"])) <= GOAL_BSR + EDGE)


def inside_spread(row: dict, references: list[dict]) -> bool:
    """TA and BSR each inside the range that `references` (retrainings in other training orders) span, widened
    by the goal's window: the verdict where retraining misses the window against itself, so that |Δ| to one
    retraining cannot tell a removal from another retraining."""
    return all(min(100 * r[key] for r in references) - window - EDGE <= 100 * row[key]
               <= max(100 * r[key] for r in references) + window + EDGE
               for key, window in (("ta", GOAL_TA), ("bsr", GOAL_BSR)))
