"""A task: a `datasets.DatasetDict` with train/test splits, an input column (text, or a datasets
`Image` for image tasks), a ClassLabel label column and a metric. This is the unit every
partitioner, client and evaluator works with.

A *free-text* task (instruction tuning on prompt/response rows, for a causal LM) has a string answer
column in place of the ClassLabel: no label names, no chance level, and a free-text metric
(`hf_fedtask.metrics.FREE_TEXT_METRICS`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import ClassLabel, DatasetDict, Image, Value

FREE_TEXT_METRIC = "token_accuracy"  # a free-text task's default metric (hf_fedtask.metrics.FREE_TEXT_METRICS)


def is_free_text(feature) -> bool:
    """Whether a label column's feature holds free-text answers (a string column) rather than classes."""
    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


@dataclass
class Task:
    """`text_column` names the input column whatever the modality: a string column makes a text
    task, an `Image` column an image task (the field name predates image tasks)."""

    name: str
    dataset: DatasetDict
    text_column: str = "text"
    label_column: str = "label"
    metric: str | None = None  # None: "accuracy", or FREE_TEXT_METRIC for a free-text task
    group: str | None = None
    description: str = ""
    extra: dict = field(default_factory=dict)
    # what a causal LM is asked (`hf_fedtask.model.instructions`): the builtin tasks' question; empty for
    # a dataset whose input column already holds the whole prompt
    instruction: str = ""

    def __post_init__(self):
        for split in ("train", "test"):
            if split not in self.dataset:
                raise ValueError(f"task {self.name!r}: missing split {split!r}")
        features = self.dataset["train"].features
        for col in (self.text_column, self.label_column):
            if col not in features:
                raise ValueError(f"task {self.name!r}: missing column {col!r}")
        from hf_fedtask.metrics import FREE_TEXT_METRICS

        if self.free_text:
            self.metric = self.metric or FREE_TEXT_METRIC
            if self.metric not in FREE_TEXT_METRICS:
                raise ValueError(f"task {self.name!r}: metric {self.metric!r} scores classes; a free-text task's "
                                 f"answers are scored by {', '.join(FREE_TEXT_METRICS)}")
            return
        if not isinstance(features[self.label_column], ClassLabel):
            raise ValueError(f"task {self.name!r}: label column {self.label_column!r} must be a ClassLabel "
                             "(or a string column of free-text answers)")
        self.metric = self.metric or "accuracy"
        if self.metric in FREE_TEXT_METRICS:
            raise ValueError(f"task {self.name!r}: metric {self.metric!r} scores free-text answers; the label "
                             f"column {self.label_column!r} holds classes")

    @property
    def modality(self) -> str:
        """"image" when the input column is a datasets `Image` feature, else "text"."""
        return "image" if isinstance(self.dataset["train"].features[self.text_column], Image) else "text"

    @property
    def free_text(self) -> bool:
        """Whether the answers are free text (a string column), not classes."""
        return is_free_text(self.dataset["train"].features[self.label_column])

    @property
    def label_names(self) -> list[str]:
        """The class names in label-id order; none for a free-text task."""
        if self.free_text:
            return []
        return list(self.dataset["train"].features[self.label_column].names)

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @property
    def chance(self) -> float | None:
        """Accuracy of always predicting the most frequent test label (None for a free-text task: no
        label to predict)."""
        if self.free_text:
            return None
        labels = self.dataset["test"][self.label_column]
        return max(labels.count(c) for c in set(labels)) / len(labels)


def prepared(dataset, encode, key: str, features=None):
    """`dataset.map(encode)` in memory, batched, every original column dropped and without a progress bar
    (hundreds of tiny maps: one bar each would drown the run's own), fingerprinted by the dataset's
    fingerprint and `key` (what else decides the result): otherwise `datasets` dill-hashes `encode`'s
    closure, tokenizer included, on every call."""
    import hashlib

    import datasets

    fingerprint = hashlib.sha256(f"{dataset._fingerprint}|{key}".encode()).hexdigest()[:16]
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return dataset.map(encode, batched=True, remove_columns=dataset.column_names, keep_in_memory=True,
                           new_fingerprint=fingerprint, features=features)
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


@dataclass(frozen=True)
class TaskInfo:
    """What a task is without its data (names, labels, metric): enough to lay out, export and card a
    finished run whose datasets are gone. `Task.info()` gives one; results.json records them."""

    name: str
    label_names: tuple[str, ...]
    metric: str = "accuracy"
    modality: str = "text"
    chance: float | None = None
    group: str | None = None
    instruction: str = ""

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @property
    def free_text(self) -> bool:
        from hf_fedtask.metrics import FREE_TEXT_METRICS

        return self.metric in FREE_TEXT_METRICS
