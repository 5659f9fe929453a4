"""Load and evaluate an exported adapter with stock PEFT only — the path a user without our
training code takes, and the independent check of the numbers in results.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from hf_fedtask.model.backbone import load_classifier, load_inputs, resolve_base_model
from hf_fedtask.errors import ConfigError, FedTaskError


def load_adapter_model(adapter_dir: str | Path):
    """`(PeftModel, processor)` for an adapter folder: the base named in adapter_config.json (the
    embedded copy for the default MiniLM), a head sized from the saved classifier weights; the
    processor is the base model's tokenizer (text) or image processor (vision)."""
    model, inputs = _load_adapter(adapter_dir)
    return model, inputs.processor


def _load_adapter(adapter_dir: str | Path, max_length: int = 32):
    """`(PeftModel, input preparer)`; see `load_adapter_model`."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / "adapter_config.json"
    weights = adapter_dir / "adapter_model.safetensors"
    if not config_file.exists() or not weights.exists():
        raise ConfigError(f"{adapter_dir}: not a PEFT adapter folder (needs adapter_config.json and adapter_model.safetensors)")
    base_id = json.loads(config_file.read_text())["base_model_name_or_path"]
    with safe_open(str(weights), "pt") as f:
        head = [k for k in f.keys() if k.endswith(("classifier.weight", "score.weight"))]  # noqa: SIM118 (safe_open)
        if not head:
            raise ConfigError(f"{weights}: no classification head (classifier.weight) in the adapter")
        num_labels = f.get_slice(head[0]).get_shape()[0]
    ref = resolve_base_model(base_id)
    base = load_classifier(ref, num_labels)
    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    except (RuntimeError, ValueError, KeyError) as e:
        raise FedTaskError(f"{adapter_dir}: does not load onto {base_id} ({str(e).splitlines()[0]})") from None
    return model.eval(), load_inputs(ref, max_length)


@torch.no_grad()
def evaluate_adapter(adapter_dir: str | Path, task: str, *, split: str = "test", max_length: int = 32,
                     batch_size: int = 128) -> dict:
    """Accuracy of the adapter on `task`'s split, computed with stock PEFT + transformers."""
    from hf_fedtask.data import load_task

    model, inputs = _load_adapter(adapter_dir, max_length)
    t = load_task(task)
    if split not in t.dataset:
        raise ConfigError(f"task {t.name!r} has no split {split!r}")
    if t.modality != inputs.modality:
        raise ConfigError(f"task {t.name!r} has {t.modality} inputs but the adapter's base model takes {inputs.modality}")
    data = t.dataset[split]
    preds = [model(**inputs.batch(batch[t.text_column])).logits.argmax(-1) for batch in data.iter(batch_size)]
    labels = np.asarray(data[t.label_column])
    accuracy = float((torch.cat(preds).numpy() == labels).mean())
    return {"task": t.name, "split": split, "accuracy": accuracy, "num_examples": len(labels)}
