"""Per-task modules in one folder, in PEFT's multi-adapter layout (what `PeftModel.save_pretrained`
writes for a model with several named adapters): the first task's adapter at the root, every other
task's in a subfolder named after it, and a `tasks.json` index. Stock PEFT loads it:

    base = AutoModelForSequenceClassification.from_pretrained(base_id, num_labels=<index num_labels>)
    model = PeftModel.from_pretrained(base, folder, adapter_name=first_task)
    model.load_adapter(f"{folder}/{task}", adapter_name=task)
    model.set_adapter(task)                                    # now `task`'s model

One base model, one head per adapter: PEFT copies the base classifier for every adapter, so all
heads must share one shape. Heads of tasks with fewer classes are padded to the largest class count
with zero weights and a bias of PAD_BIAS: the padded logits never win an argmax and get ~0
probability, and the first `num_labels` logits are the task's own (`tasks.json` has each task's
num_labels and label names).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from peft import PeftConfig

from hf_fedtask.core.files import staged_folder
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import ConfigError
from hf_fedtask.export.adapter import save_adapter

INDEX_FILE = "tasks.json"
PAD_BIAS = -1.0e4


def pad_head(state: TaskVector, head_keys: list[str], num_labels: int) -> TaskVector:
    """`state` with its head rows padded to `num_labels` (weights 0, bias PAD_BIAS)."""
    out = dict(state)
    for key in head_keys:
        t = state[key]
        extra = num_labels - t.shape[0]
        if extra < 0:
            raise ConfigError(f"head {key!r} has {t.shape[0]} rows, more than {num_labels}")
        fill = torch.full((extra, *t.shape[1:]), PAD_BIAS if key.endswith("bias") else 0.0, dtype=t.dtype,
                          device=t.device)
        out[key] = torch.cat([t, fill])
    return TaskVector(out)


def save_multi_adapter(
    folder: str | os.PathLike,
    *,
    peft_config: PeftConfig,
    task_states: Mapping[str, TaskVector],
    head_keys: list[str],
    label_names: Mapping[str, list[str]],
    base_model_id: str,
    card: str | None = None,
) -> Path:
    """Write every task's adapter (`task_states`: PEFT saved naming, head included) into `folder`,
    atomically; the first task's goes to the root."""
    tasks = list(task_states)
    if not tasks:
        raise ConfigError("save_multi_adapter: no tasks")
    width = max(len(names) for names in label_names.values())
    index = {"num_labels": width, "first": tasks[0], "tasks": {}}
    out = Path(folder).absolute()
    with staged_folder(out) as staging:
        for i, task in enumerate(tasks):
            save_adapter(staging / task, peft_config=peft_config, base_model_id=base_model_id,
                         state_dict=pad_head(task_states[task], head_keys, width))
            if i == 0:  # the first adapter lives at the root, as PeftModel.save_pretrained puts "default"
                for file in (staging / task).iterdir():
                    os.replace(file, staging / file.name)
                (staging / task).rmdir()
            index["tasks"][task] = {"path": "." if i == 0 else task, "num_labels": len(label_names[task]),
                                    "label_names": list(label_names[task])}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if card is not None:
            (staging / "README.md").write_text(card, encoding="utf-8")
    return out
