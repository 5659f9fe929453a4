"""A task: a `datasets.DatasetDict` with train/test splits, an input column (text, or a datasets
`Image` for image tasks), a ClassLabel label column and a metric. This is the unit every
partitioner, client and evaluator works with."""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import ClassLabel, DatasetDict, Image


@dataclass
class Task:
    """`text_column` names the input column whatever the modality: a string column makes a text
    task, an `Image` column an image task (the field name predates image tasks)."""

    name: str
    dataset: DatasetDict
    text_column: str = "text"
    label_column: str = "label"
    metric: str = "accuracy"
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
        if not isinstance(features[self.label_column], ClassLabel):
            raise ValueError(f"task {self.name!r}: label column {self.label_column!r} must be a ClassLabel")

    @property
    def modality(self) -> str:
        """"image" when the input column is a datasets `Image` feature, else "text"."""
        return "image" if isinstance(self.dataset["train"].features[self.text_column], Image) else "text"

    @property
    def label_names(self) -> list[str]:
        return list(self.dataset["train"].features[self.label_column].names)

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @property
    def chance(self) -> float:
        """Accuracy of always predicting the most frequent test label."""
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
