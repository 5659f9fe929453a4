"""Load and evaluate an exported adapter with stock PEFT only — the path a user without our
training code takes, and the independent check of the numbers in results.json."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from hf_fedtask.errors import ConfigError, FedTaskError
from hf_fedtask.export.adapter import CLASSIFIER_SUBFOLDER, load_adapter_base, read_adapter_folder
from hf_fedtask.metrics import compute
from hf_fedtask.model.backbone import load_inputs
from hf_fedtask.model.device import model_device, to_device


def load_adapter_model(adapter_dir: str | Path):
    """`(PeftModel, processor)` for an adapter folder: the base named in adapter_config.json (the
    embedded copy for the default MiniLM), a head sized from the saved classifier weights and named
    by the folder's `classifier/config.json` (so pipelines answer label names); the processor is the
    base model's tokenizer (text) or image processor (vision)."""
    model, inputs = _load_adapter(adapter_dir)
    return model, inputs.processor


def _load_adapter(adapter_dir: str | Path, max_length: int = 32):
    """`(PeftModel, input preparer)`; see `load_adapter_model`."""
    adapter_dir = Path(adapter_dir)
    config, tensors = read_adapter_folder(adapter_dir)
    head = [k for k in tensors if k.endswith(("classifier.weight", "score.weight"))]
    if config.get("task_type") == "CAUSAL_LM":  # a causal LM answers in words: no head to size
        ref, base = load_adapter_base(config["base_model_name_or_path"], 0, adapter_dir)
        return _peft_model(base, adapter_dir, config["base_model_name_or_path"]), load_inputs(ref, max_length)
    if not head:
        raise ConfigError(f"{adapter_dir / 'adapter_model.safetensors'}: no classification head "
                          "(classifier.weight) in the adapter")
    base_id = config["base_model_name_or_path"]
    ref, base = load_adapter_base(base_id, tensors[head[0]].shape[0], adapter_dir)
    labels = _label_names(adapter_dir)
    if labels is not None and len(labels) == tensors[head[0]].shape[0]:
        base.config.id2label = dict(enumerate(labels))
        base.config.label2id = {name: i for i, name in enumerate(labels)}
    return _peft_model(base, adapter_dir, base_id), load_inputs(ref, max_length)


def _peft_model(base, adapter_dir: Path, base_id: str):
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        raise FedTaskError(f"{adapter_dir}: does not load onto {base_id} ({str(e).splitlines()[0]})") from None


def _label_names(adapter_dir: Path) -> list[str] | None:
    """The label names an exported adapter carries (`classifier/config.json`), if any."""
    from transformers import AutoConfig

    if not (adapter_dir / CLASSIFIER_SUBFOLDER / "config.json").is_file():
        return None
    config = AutoConfig.from_pretrained(str(adapter_dir), subfolder=CLASSIFIER_SUBFOLDER)
    return [config.id2label[i] for i in range(len(config.id2label))]


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
        raise ConfigError(f"task {t.name!r} has {t.modality} inputs but the adapter's base model takes "
                          f"{inputs.modality}")
    data = inputs.prepare(t.dataset[split], t)  # as a run prepares it: token ids, pixels, or instructions
    device = model_device(model)
    loader = DataLoader(data, batch_size=batch_size, collate_fn=inputs.eval_collator)
    preds = [inputs.predict_batch(model, to_device(batch, device)).cpu() for batch in loader]
    labels = np.asarray(data["labels"])
    accuracy = compute("accuracy", labels, torch.cat(preds).numpy())
    return {"task": t.name, "split": split, "accuracy": accuracy, "num_examples": len(labels)}
