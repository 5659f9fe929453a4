"""Write a trained adapter as a standard PEFT folder, the same files `PeftModel.save_pretrained`
writes, so stock `PeftModel.from_pretrained` loads it and it can be pushed to the Hub as is."""

import copy
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from huggingface_hub import ModelCard
from huggingface_hub.utils import validate_repo_id
from peft import PeftConfig
from peft.utils import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import save_file

from hf_fedtask.core.files import staged_folder


def check_portable_base_model_id(base_model_id: str) -> None:
    """Raise ValueError unless `base_model_id` is a Hub model id: a local path in
    adapter_config.json only resolves on the machine that wrote it."""
    if not isinstance(base_model_id, str):
        raise ValueError(f"base_model_id {base_model_id!r} is not a Hub model id (e.g. 'org/name')")
    if os.path.isabs(os.path.expanduser(base_model_id)) or os.path.exists(base_model_id):
        raise ValueError(f"base_model_id {base_model_id!r} is a local path, not a Hub model id (e.g. 'org/name')")
    try:
        validate_repo_id(base_model_id)
    except ValueError as err:
        raise ValueError(f"base_model_id {base_model_id!r} is not a valid Hub model id: {err}") from None


def _safetensors_ready(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous tensors with no shared storage, as safetensors requires and as
    PEFT's own saver prepares them."""
    seen: set[tuple] = set()
    out = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach().contiguous()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        out[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


def _write_files(folder: Path, peft_config: PeftConfig, state_dict, base_model_id: str, card) -> None:
    config = copy.deepcopy(peft_config)
    config.base_model_name_or_path = base_model_id
    config.inference_mode = True  # what PeftModel.save_pretrained records
    config.save_pretrained(str(folder))
    save_file(_safetensors_ready(state_dict), str(folder / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    if card is not None:
        (folder / "README.md").write_text(str(card), encoding="utf-8")


def save_adapter(
    out_dir: str | os.PathLike,
    *,
    peft_config: PeftConfig,
    state_dict: Mapping[str, torch.Tensor],
    base_model_id: str,
    card: str | ModelCard | None = None,
) -> Path:
    """Write `adapter_config.json`, `adapter_model.safetensors` and, when `card` is given,
    `README.md` to `out_dir`, and return it.

    `state_dict` uses PEFT's saved key names, i.e. what `peft.get_peft_model_state_dict` returns
    (classification head included). `base_model_id` becomes `base_model_name_or_path` and must be a
    Hub id. The folder is built next to `out_dir` and swapped in only when complete
    (`hf_fedtask.core.files.staged_folder`), so a failure never leaves a half-written one.
    """
    check_portable_base_model_id(base_model_id)
    with staged_folder(Path(out_dir)) as staging:
        _write_files(staging, peft_config, state_dict, base_model_id, card)
    return Path(out_dir).absolute()
