"""A linearized model on disk, and back. A linearized model is not a plain adapter: it is the
expansion point θ_lin (a stock PEFT adapter folder, head included) plus the delta θ − θ_lin, read
back by `load_linearized` as a module computing f(θ_lin) + J(θ_lin)·(θ − θ_lin).

    <folder>/point/                 stock PEFT adapter folder of θ_lin
    <folder>/delta.safetensors      θ − θ_lin, in PEFT's saved key naming
    <folder>/linearized.json        {"mode": "network" | "lora_layers", "num_labels": ..., and what the
                                     exporter adds (task, metrics)}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from peft import PeftConfig
from peft.utils import SAFETENSORS_WEIGHTS_NAME

from hf_fedtask.core.files import staged_folder
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import ConfigError, FedTaskError, TaskVectorError
from hf_fedtask.export.adapter import save_adapter
from hf_fedtask.model.linearize import MODES, LinearizedModel

POINT_DIR = "point"
DELTA_FILE = "delta.safetensors"
INFO_FILE = "linearized.json"


def save_linearized(
    folder: str | os.PathLike,
    *,
    peft_config: PeftConfig,
    point: Mapping[str, torch.Tensor],
    delta: Mapping[str, torch.Tensor],
    base_model_id: str,
    num_labels: int,
    mode: str = "network",
    info: dict | None = None,
    card: str | None = None,
) -> Path:
    """Write the package atomically (the folder is swapped in only when complete)."""
    if mode not in MODES:
        raise ConfigError(f"unknown linearization mode {mode!r}; choose one of {', '.join(MODES)}")
    if set(point) != set(delta):
        raise TaskVectorError(f"{folder}: point and delta hold different keys")
    out = Path(folder).absolute()
    with staged_folder(out) as staging:
        save_adapter(staging / POINT_DIR, peft_config=peft_config, state_dict=point, base_model_id=base_model_id)
        TaskVector(dict(delta)).save(staging / DELTA_FILE)
        (staging / INFO_FILE).write_text(
            json.dumps({"mode": mode, "num_labels": num_labels, **(info or {})}, indent=2) + "\n")
        if card is not None:
            (staging / "README.md").write_text(card, encoding="utf-8")
    return out


def load_linearized(folder: str | os.PathLike, base_model: str | None = None) -> LinearizedModel:
    """The linearized model saved in `folder` (eval mode): a `LinearizedModel` around the stock
    PEFT adapter `point/`, moved by `delta.safetensors`, on the CPU (`.to(device)` moves it, θ_lin
    included). `base_model` (local folder or Hub id) overrides the base recorded in the adapter config."""
    from peft import PeftModel, set_peft_model_state_dict

    from hf_fedtask.model.backbone import load_classifier, quiet_peft_wrap, resolve_base_model

    folder = Path(folder)
    try:
        info = json.loads((folder / INFO_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise TaskVectorError(f"{folder / INFO_FILE}: cannot read ({' '.join(str(exc).split())})") from None
    config = PeftConfig.from_pretrained(str(folder / POINT_DIR))
    weights = folder / POINT_DIR / SAFETENSORS_WEIGHTS_NAME
    try:
        point = TaskVector(safetensors.torch.load_file(weights))
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise TaskVectorError(f"{weights}: cannot read adapter weights ({' '.join(str(exc).split())})") from None
    delta = TaskVector.load(folder / DELTA_FILE, template=point)
    name = base_model or config.base_model_name_or_path
    try:
        model = load_classifier(resolve_base_model(name), info["num_labels"])
        with quiet_peft_wrap():
            peft_model = PeftModel.from_pretrained(model, str(folder / POINT_DIR), is_trainable=True)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise FedTaskError(f"{folder}: does not load onto {name} ({str(exc).splitlines()[0]})") from None
    lin = LinearizedModel(peft_model, mode=info["mode"])  # the point: the adapter's parameters as loaded
    set_peft_model_state_dict(peft_model, dict(point + delta))
    return lin.eval()
