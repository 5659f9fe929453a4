"""Individual centralized fine-tuning: one PEFT adapter trained per task on the task's whole train
split. Its accuracy is the normalizer of "normalized accuracy" (MaTU) and the upper reference in
results tables. Values for the builtin suites are computed by `recipes/individual_centralized.py`
and shipped in `hf_fedtask/data/builtin_reference.json`."""

from __future__ import annotations

import json
from importlib import resources

from tqdm.auto import tqdm

from .config import RunConfig
from .data.task import Task
from .evaluation import evaluate
from .federation import build_host, build_trainer
from .taskvector import TaskVector

REFERENCE_FILE = "builtin_reference.json"
# The optimizer recipe of the shipped reference values; part of the cache key.
REFERENCE_KEYS = ("base_model", "peft_method", "lora_r", "lora_alpha", "max_length", "local_epochs", "batch_size",
                  "learning_rate", "lr_scheduler", "seed")


def reference_key(config: RunConfig) -> str:
    return json.dumps({k: getattr(config, k) for k in REFERENCE_KEYS}, sort_keys=True)


def individual_centralized(tasks: list[Task], config: RunConfig) -> dict[str, dict]:
    """Train one adapter + head per task from the shared init for `config.local_epochs` epochs on
    the full train split; return `{task: {metric: value, "num_examples": n}}` on the test split."""
    host = build_host(config)
    trainer = build_trainer(host, config)
    shared = host.initial_shared()
    out = {}
    for i, task in enumerate(tqdm(tasks, desc="individual centralized", dynamic_ncols=True)):
        start = TaskVector({**shared, **host.initial_head(task.num_labels, seed=config.seed * 1000 + i)})
        trained, _ = trainer.train(start, host.tokenize(task.dataset["train"], task), seed=config.seed)
        out[task.name] = evaluate(host, trained, host.tokenize(task.dataset["test"], task), task.metric,
                                  config.eval_batch_size)
    return out


def shipped_reference(config: RunConfig | None = None) -> dict[str, dict]:
    """The shipped per-task reference metrics (empty when none were computed for this recipe)."""
    path = resources.files("hf_fedtask.data").joinpath(REFERENCE_FILE)
    if not path.is_file():
        return {}
    entries = json.loads(path.read_text())
    key = reference_key(config or RunConfig())
    return next((e["tasks"] for e in entries if e["key"] == key), {})
