"""Per-task modules in one folder, in PEFT's multi-adapter layout (what `PeftModel.save_pretrained`
writes for a model with several named adapters): the first task's adapter at the root, every other
task's in a subfolder named after it, and a `tasks.json` index. Stock PEFT loads it:

    base = AutoModelForSequenceClassification.from_pretrained(base_id, num_labels=<the task's num_labels>)
    model = PeftModel.from_pretrained(base, folder, adapter_name=first_task)
    model.load_adapter(f"{folder}/{task}", adapter_name=task)  # a task with as many labels
    model.set_adapter(task)                                    # now `task`'s model

Every task's head has its task's own number of labels, so a reloaded task answers with exactly its
own logits. PEFT copies the base's one classifier for every adapter a model holds
(`ModulesToSaveWrapper`), so tasks switch within one model only among heads of one size; a task of
another size loads onto its own base. Each folder (the root for the first task) also carries the
tokenizer or image processor, `classifier/config.json` (label names) and `hf_fedtask.json`, so it loads
by the route every exported adapter does (`AutoConfig.from_pretrained(folder, subfolder="classifier")`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from peft import PeftConfig

from hf_fedtask.core.files import staged_folder
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import ConfigError
from hf_fedtask.export.adapter import CLASSIFIER_SUBFOLDER, save_adapter

INDEX_FILE = "tasks.json"


def save_multi_adapter(
    folder: str | os.PathLike,
    *,
    peft_config: PeftConfig,
    task_states: Mapping[str, TaskVector],
    label_names: Mapping[str, list[str]],
    base_model_id: str,
    card: str | None = None,
    classifier_configs: Mapping[str, object] | None = None,
    processor=None,
    metadata: Mapping[str, Mapping] | None = None,
) -> Path:
    """Write every task's adapter (`task_states`: PEFT saved naming, its own head included) into `folder`,
    atomically; the first task's goes to the root. `classifier_configs`, `processor` and `metadata` are
    `save_adapter`'s, per task (the processor is the same for all)."""
    tasks = list(task_states)
    if not tasks:
        raise ConfigError("save_multi_adapter: no tasks")
    for task in tasks:
        if task in (CLASSIFIER_SUBFOLDER, INDEX_FILE):
            raise ConfigError(f"save_multi_adapter: task name {task!r} is a name the folder uses itself")
    index = {"first": tasks[0], "tasks": {}}
    out = Path(folder).absolute()
    with staged_folder(out) as staging:
        for i, task in enumerate(tasks):
            save_adapter(staging / task, peft_config=peft_config, base_model_id=base_model_id,
                         state_dict=task_states[task], processor=processor,
                         classifier_config=(classifier_configs or {}).get(task),
                         metadata=(metadata or {}).get(task))
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
