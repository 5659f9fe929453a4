"""Individual centralized fine-tuning: one PEFT adapter trained per task on the task's whole train
split, the normalizer of "normalized accuracy" (`hf_fedtask.data.reference` reads the shipped values)."""

from __future__ import annotations

from tqdm.auto import tqdm

from hf_fedtask.client.evaluation import evaluate
from hf_fedtask.config import RunConfig
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.data import SUITE_VERSION
from hf_fedtask.data.task import Task
from hf_fedtask.engine.environment import build_host, build_trainer
from hf_fedtask.errors import ConfigError

# The recipe keys recorded with shipped reference values.
RECIPE_KEYS = ("base_model", "peft_method", "lora_r", "lora_alpha", "max_length", "local_epochs", "batch_size",
               "learning_rate", "lr_scheduler", "seed")


def individual_centralized(tasks: list[Task], config: RunConfig) -> dict[str, dict]:
    """Train one adapter + head per task from the shared init for `config.local_epochs` epochs on
    the full train split; return `{task: {metric: value, "num_examples": n}}` on the test split."""
    if config.output_space != "per_task":
        raise ConfigError(f"individual centralized training fits one head per task: output_space "
                          f"{config.output_space!r} does not apply (use per_task)")
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


def reference_record(results: dict[str, dict], config: RunConfig) -> dict:
    """What `recipes/individual_centralized.py` ships: values plus the recipe and suite version."""
    return {"suite_version": SUITE_VERSION, "recipe": {k: getattr(config, k) for k in RECIPE_KEYS}, "tasks": results}


