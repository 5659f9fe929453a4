"""Where each task's labels live in the classification head.

- `per_task` (default): every task has its own head, as wide as its label set, kept beside the
  shared PEFT modules (`head/<task>` in the state); strategies average heads per task.
- `max`: one head shared by every task, as wide as the task with the most labels; task label j is
  output j (the usual "shared output layer" of multi-task FL baselines).
- `union`: one shared head over the union of the tasks' label sets; task t's label j is output
  offset_t + j, so no two tasks share an output.

A shared head is part of the shared PEFT state, so every strategy treats it as it treats the PEFT
modules: FedAvg averages it over all clients, MaTU masks and rescales it inside the task vectors,
FedPer keeps it personal. Training targets are moved to the task's rows (`union`); a task is
evaluated and exported with only its own rows of the head (`task_view`), so its adapter is an
ordinary `num_labels`-way classifier that stock PEFT loads, and its reported accuracy is what that
adapter answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from datasets import Dataset

from hf_fedtask.core.names import MAX, OUTPUT_SPACES, PER_TASK
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import ConfigError


@dataclass(frozen=True)
class OutputSpace:
    """The head layout of a run: `kind` and, for a shared head, each task's rows `[start, stop)`."""

    kind: str
    rows: dict[str, tuple[int, int]]
    labels: tuple[str, ...] = ()  # what each output of a shared head stands for

    @classmethod
    def build(cls, kind: str, tasks: Sequence) -> OutputSpace:
        """The layout for `tasks` (anything with `name`, `label_names`), in their order."""
        if kind not in OUTPUT_SPACES:
            raise ConfigError(f"config: output_space must be one of {', '.join(OUTPUT_SPACES)}, got {kind!r}")
        if kind == PER_TASK:
            return cls(kind, {t.name: (0, len(t.label_names)) for t in tasks})
        if kind == MAX:
            width = max(len(t.label_names) for t in tasks)
            labels = tuple("/".join(sorted({t.label_names[j] for t in tasks if j < len(t.label_names)}))
                           for j in range(width))
            return cls(kind, {t.name: (0, len(t.label_names)) for t in tasks}, labels)
        rows, labels, start = {}, [], 0
        for t in tasks:
            rows[t.name] = (start, start + len(t.label_names))
            labels += [f"{t.name}:{name}" for name in t.label_names]
            start += len(t.label_names)
        return cls(kind, rows, tuple(labels))

    @property
    def shared(self) -> bool:
        return self.kind != PER_TASK

    @property
    def width(self) -> int:
        """Outputs of the shared head (0 with per-task heads)."""
        return len(self.labels)

    def train_labels(self, data: Dataset, task: str) -> Dataset:
        """Prepared training `data` of `task` with its labels moved to the task's rows of the head."""
        offset = self.rows[task][0] if self.shared else 0
        if not offset:
            return data
        return data.map(lambda labels: {"labels": [int(y) + offset for y in labels]}, batched=True,
                        input_columns="labels")

    def task_view(self, params: TaskVector, task: str, head_keys: Sequence[str]) -> TaskVector:
        """`params` (shared modules + head) with the head cut to `task`'s own rows: the task's
        `num_labels`-way classifier. Unchanged with per-task heads."""
        if not self.shared:
            return params
        start, stop = self.rows[task]
        heads = set(head_keys)
        return TaskVector({k: v[start:stop] if k in heads else v for k, v in params.items()})

    def describe(self, task: str) -> str | None:
        """A sentence for `task`'s model card (None with per-task heads)."""
        if not self.shared:
            return None
        start, stop = self.rows[task]
        how = ("as wide as the task with the most labels, so tasks share outputs" if self.kind == MAX
               else "over the union of all tasks' labels, one output per task label")
        return (f"Trained with one classification head shared by all {len(self.rows)} tasks ({self.width} outputs, "
                f"output space `{self.kind}`: {how}); this adapter carries that head's outputs {start}-{stop - 1}, "
                f"this task's labels. The full head's outputs: {', '.join(self.labels)}.")
