"""TCT's stage-2 model on disk, and back. It is not a plain adapter: it is a feature map (the stage-1
network θ_{T₁} with the re-initialized head whose first output is differentiated) plus a linear
model on its normalized eNTK features.

    <folder>/feature_network/       stock PEFT adapter folder: θ_{T₁} and the feature head
    <folder>/linear.safetensors     index (the p coordinates), mean, std, weight (p × C), bias (C)
    <folder>/tct.json               {"task", "label_names", "output": 0, "metrics", ...}
    <folder>/README.md              the card

`load_tct(folder)` returns a `TCTClassifier`: `model(**inputs)` gives the logits z̃ᵀW + b of a batch
prepared by the base model's tokenizer or image processor (`model.prepare(raw inputs)`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from peft import PeftConfig, get_peft_model_state_dict

from hf_fedtask.core.files import staged_folder
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import FedTaskError, TaskVectorError
from hf_fedtask.export.adapter import save_adapter

NETWORK_DIR = "feature_network"
LINEAR_FILE = "linear.safetensors"
INFO_FILE = "tct.json"


def save_tct(folder: str | os.PathLike, *, peft_config: PeftConfig, network: Mapping[str, torch.Tensor],
             linear: Mapping[str, torch.Tensor], base_model_id: str, info: dict, card: str | None = None) -> Path:
    """Write the package atomically. `network`: θ_{T₁} with the feature head (PEFT saved names);
    `linear`: index, mean, std, weight and (optionally) bias."""
    missing = [k for k in ("index", "mean", "std", "weight") if k not in linear]
    if missing:
        raise TaskVectorError(f"{folder}: the linear model lacks {missing[0]!r}")
    out = Path(folder).absolute()
    with staged_folder(out) as staging:
        save_adapter(staging / NETWORK_DIR, peft_config=peft_config, state_dict=network, base_model_id=base_model_id)
        TaskVector(dict(linear)).save(staging / LINEAR_FILE)
        (staging / INFO_FILE).write_text(json.dumps({"output": 0, **info}, indent=2) + "\n")
        if card is not None:
            (staging / "README.md").write_text(card, encoding="utf-8")
    return out


class TCTClassifier(torch.nn.Module):
    """The stage-2 predictor: eNTK features of the feature network at the saved coordinates,
    standardized, times W, plus b. `.to(device)` moves the network and the linear model; raw inputs
    go to the network's device, the features come back on the linear model's."""

    def __init__(self, network: torch.nn.Module, paths: list[str], linear: Mapping[str, torch.Tensor], inputs,
                 info: dict):
        super().__init__()
        self.network, self.paths, self.inputs, self.info = network, paths, inputs, info
        for key, value in linear.items():
            self.register_buffer(key.replace(".", "_"), value)
        self.has_bias = "bias" in linear

    @property
    def label_names(self) -> list[str]:
        return list(self.info.get("label_names", []))

    def features(self, **batch: torch.Tensor) -> torch.Tensor:
        from hf_fedtask.model.entk import model_features

        batch = {k: v for k, v in batch.items() if k != "labels"}
        return model_features(self.network, self.paths, [batch], self.index, output=int(self.info.get("output", 0)))

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        z = self.features(**batch).to(self.mean.device)  # model_features returns CPU rows
        logits = ((z - self.mean) / self.std) @ self.weight
        return logits + self.bias if self.has_bias else logits

    def prepare(self, raw: list) -> dict[str, torch.Tensor]:
        """Model inputs for raw texts or PIL images."""
        return self.inputs.batch(raw)

    def predict(self, raw: list) -> list[str]:
        """Label names for raw texts or PIL images."""
        ids = self(**self.prepare(raw)).argmax(-1).tolist()
        return [self.label_names[i] for i in ids] if self.label_names else ids


def load_tct(folder: str | os.PathLike, base_model: str | None = None) -> TCTClassifier:
    """The TCT model saved in `folder`. `base_model` (local folder or Hub id) overrides the base
    recorded in the feature network's adapter config."""
    from peft import PeftModel

    from hf_fedtask.model.backbone import load_classifier, load_inputs, quiet_peft_wrap, resolve_base_model

    folder = Path(folder)
    try:
        info = json.loads((folder / INFO_FILE).read_text())
        linear = safetensors.torch.load_file(folder / LINEAR_FILE)
    except (OSError, ValueError, safetensors.SafetensorError) as exc:
        raise TaskVectorError(f"{folder}: not a TCT package ({' '.join(str(exc).split())[:200]})") from None
    config = PeftConfig.from_pretrained(str(folder / NETWORK_DIR))
    name = base_model or config.base_model_name_or_path
    try:
        ref = resolve_base_model(name)
        with quiet_peft_wrap():
            model = PeftModel.from_pretrained(load_classifier(ref, len(info["label_names"])), str(folder / NETWORK_DIR))
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise FedTaskError(f"{folder}: does not load onto {name} ({str(exc).splitlines()[0]})") from None
    saved = get_peft_model_state_dict(model)
    by_ptr = {p.data_ptr(): path for path, p in model.named_parameters()}
    paths = [by_ptr[saved_tensor.data_ptr()] for saved_tensor in _live(model, saved)]
    return TCTClassifier(model.eval(), paths, linear, load_inputs(ref), info).eval()


def _live(model, saved: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The live parameters behind PEFT's saved state dict, in its order (a saved tensor may be a
    detached view: matched by storage pointer)."""
    ptrs = {p.data_ptr(): p for p in model.parameters()}
    missing = [k for k, t in saved.items() if t.data_ptr() not in ptrs]
    if missing:
        raise FedTaskError(f"parameter {missing[0]!r} of the feature network is not a live parameter")
    return [ptrs[t.data_ptr()] for t in saved.values()]
