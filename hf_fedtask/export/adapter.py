"""Write a trained adapter as a standard PEFT folder, the same files `PeftModel.save_pretrained`
writes, so stock `PeftModel.from_pretrained` loads it and it can be pushed to the Hub as is."""

import copy
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from huggingface_hub import ModelCard
from huggingface_hub.utils import validate_repo_id
from peft import PeftConfig
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import save_file

from hf_fedtask.core.files import staged_folder
from hf_fedtask.core.taskvector_file import safetensors_ready
from hf_fedtask.errors import ConfigError, FedTaskError, TaskVectorError


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


CLASSIFIER_SUBFOLDER = "classifier"
"""Where an adapter folder keeps the transformers config of the classifier it completes (label names,
`num_labels`, architecture): `AutoConfig.from_pretrained(adapter_dir, subfolder="classifier")`. Not at
the folder's root: a root `config.json` makes transformers treat the folder as a complete model and
look for base weights there."""


METADATA_FILE = "hf_fedtask.json"
"""What an exported adapter was trained and scored on, so `hf-fedtask evaluate` and `merge` can check a task
against it and reproduce the run's numbers: the task (name, the reference it was loaded by, label names),
the input kind (text, image, causal_lm), the run's max_length and data seed, and the test subset its card's
metric was computed on. Transformers and PEFT ignore it (as they ignore mergekit's `mergekit_config.yml`)."""
METADATA_FORMAT = "hf_fedtask.adapter"

LM_EVAL_FILE = "lm_eval.json"
"""lm-evaluation-harness's scores of the adapter in its folder (`hf-fedtask evaluate --lm-eval`), beside the card
that shows them: they belong to these weights, so a merge does not copy them and a re-export drops them."""

_GENERIC_LABEL = re.compile(r"LABEL_\d+")  # transformers' placeholder id2label: names nothing


def classifier_config_for(base_config, label_names: list[str], base_model_id: str):
    """A copy of the classifier's transformers config carrying `label_names` (id2label, label2id,
    num_labels) and the base's Hub id instead of any local path."""
    config = copy.deepcopy(base_config)
    config.id2label = dict(enumerate(label_names))
    config.label2id = {name: i for i, name in enumerate(label_names)}
    config._name_or_path = base_model_id
    return config


def _write_files(folder: Path, peft_config: PeftConfig, state_dict, base_model_id: str, card,
                 classifier_config=None, processor=None, metadata=None) -> None:
    config = copy.deepcopy(peft_config)
    config.base_model_name_or_path = base_model_id
    config.inference_mode = True  # what PeftModel.save_pretrained records
    config.save_pretrained(str(folder))
    save_file(safetensors_ready(state_dict), str(folder / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    if classifier_config is not None:
        classifier_config.save_pretrained(str(folder / CLASSIFIER_SUBFOLDER))
    if processor is not None:  # the tokenizer or image processor, as Trainer.save_model leaves it beside a model
        processor.save_pretrained(str(folder))
    if card is not None:
        (folder / "README.md").write_text(str(card), encoding="utf-8")
    if metadata is not None:
        write_metadata(folder, metadata)


def save_adapter(
    out_dir: str | os.PathLike,
    *,
    peft_config: PeftConfig,
    state_dict: Mapping[str, torch.Tensor],
    base_model_id: str,
    card: str | ModelCard | None = None,
    classifier_config=None,
    processor=None,
    metadata: Mapping | None = None,
) -> Path:
    """Write `adapter_config.json`, `adapter_model.safetensors` and, when given, `README.md` (`card`),
    `classifier/config.json` (`classifier_config`: label names, see `classifier_config_for`), the
    tokenizer or image processor files (`processor`) and `hf_fedtask.json` (`metadata`, see
    METADATA_FILE) to `out_dir`, and return it.

    `state_dict` uses PEFT's saved key names, i.e. what `peft.get_peft_model_state_dict` returns
    (classification head included). `base_model_id` becomes `base_model_name_or_path` and must be a
    Hub id. The folder is built next to `out_dir` and swapped in only when complete
    (`hf_fedtask.core.files.staged_folder`), so a failure never leaves a half-written one.
    """
    check_portable_base_model_id(base_model_id)
    with staged_folder(Path(out_dir)) as staging:
        _write_files(staging, peft_config, state_dict, base_model_id, card, classifier_config, processor, metadata)
    return Path(out_dir).absolute()


def write_metadata(folder: str | os.PathLike, metadata: Mapping) -> None:
    """Write `metadata` as the folder's METADATA_FILE, marked with its format."""
    body = {"format": METADATA_FORMAT, **metadata}
    (Path(folder) / METADATA_FILE).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")


def read_metadata(folder: str | os.PathLike) -> dict:
    """An adapter folder's METADATA_FILE ({} when it has none, e.g. an adapter made elsewhere); a file
    that is not this format's JSON object is one ConfigError naming it."""
    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict) or data.get("format") != METADATA_FORMAT:
        raise ConfigError(f"{path}: not an {METADATA_FORMAT} metadata file")
    return data


def adapter_label_names(folder: str | os.PathLike) -> list[str] | None:
    """The label names an adapter folder records, in label-id order: its `classifier/config.json`'s
    id2label (what transformers' pipelines answer), else its METADATA_FILE's `label_names` (a causal
    LM's answer words); None when it records none, or only transformers' placeholders LABEL_0, ...
    The JSON is read directly: no transformers import."""
    path = Path(folder) / CLASSIFIER_SUBFOLDER / "config.json"
    if path.is_file():
        try:
            id2label = json.loads(path.read_text(encoding="utf-8")).get("id2label") or {}
            names = [id2label[str(i)] for i in range(len(id2label))]
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
            raise ConfigError(f"{path}: no readable id2label ({' '.join(str(exc).split())})") from None
        if names and not all(_GENERIC_LABEL.fullmatch(str(n)) for n in names):
            return [str(n) for n in names]
    names = read_metadata(folder).get("label_names")
    return [str(n) for n in names] if isinstance(names, list) and names else None


# the adapter's own files, and a multi-adapter or compact folder's index: not the loading files of one adapter
_ADAPTER_OWN_FILES = {CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME, "README.md", METADATA_FILE, "tasks.json", LM_EVAL_FILE}


def copy_loading_files(source: str | os.PathLike, target: str | os.PathLike, *, classifier: bool = True) -> list[str]:
    """Copy what an exported adapter folder carries besides its adapter (the tokenizer or image processor
    files, a chat template, and with `classifier` its `classifier/config.json`) from `source` to `target`,
    so `target` loads by the same route (`AutoConfig.from_pretrained(target, subfolder="classifier")`,
    `pipeline(..., tokenizer=target)`); returns the names copied."""
    source, target = Path(source), Path(target)
    copied = []
    for item in sorted(source.iterdir()):
        if item.is_file() and item.name not in _ADAPTER_OWN_FILES:
            shutil.copy2(item, target / item.name)
            copied.append(item.name)
        elif item.is_dir() and item.name == CLASSIFIER_SUBFOLDER and classifier:
            shutil.copytree(item, target / item.name, dirs_exist_ok=True)
            copied.append(item.name)
    return copied


# -- reading adapter folders back (evaluate, push, merge, load_task_adapter share these checks) --------------


def read_adapter_config(config_file: str | os.PathLike, error: type[Exception] = ConfigError) -> dict:
    """adapter_config.json as a dict with `peft_type` and a non-empty `base_model_name_or_path`;
    anything else is one `error` naming the file and what is wrong."""
    path = Path(config_file)
    if not path.is_file():
        raise error(f"{path}: missing (not a PEFT adapter folder)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise error(f"{path}: not valid JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(config, dict) or "peft_type" not in config:
        raise error(f"{path}: not a PEFT adapter config (no peft_type)")
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        raise error(f"{path}: base_model_name_or_path is missing or empty")
    return config


def read_adapter_weights(weights: str | os.PathLike, error: type[Exception] = TaskVectorError) -> dict:
    """adapter_model.safetensors as tensors, all finite; a missing, empty, corrupt or non-finite file
    is one `error` naming the file (and the key)."""
    import safetensors.torch

    path = Path(weights)
    if not path.is_file():
        raise error(f"{path}: missing or not a file (not a PEFT adapter folder)")
    try:
        tensors = safetensors.torch.load_file(str(path))
    except Exception as exc:  # safetensors raises SafetensorError, OSError, ValueError... on bad bytes
        raise error(f"{path}: cannot read adapter weights ({' '.join(str(exc).split())[:200]})") from None
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise error(f"{path}: key {key!r} has NaN or Inf values")
    return tensors


def read_adapter_folder(folder: str | os.PathLike, error: type[Exception] = ConfigError) -> tuple[dict, dict]:
    """(adapter config, adapter tensors) of a stock PEFT adapter folder, both validated."""
    path = Path(folder)
    if not path.is_dir():
        raise error(f"{path}: no such adapter folder")
    config = read_adapter_config(path / CONFIG_NAME, error)
    tensors = read_adapter_weights(path / SAFETENSORS_WEIGHTS_NAME,
                                   error if error is not ConfigError else TaskVectorError)
    return config, tensors


def load_adapter_base(base_id: str, num_labels: int, source: str | os.PathLike):
    """The classifier an adapter's `base_model_name_or_path` names (the embedded copy for the default
    MiniLM), with `num_labels` outputs; a missing local folder or a base that cannot be loaded here
    (offline, unknown id) is one FedTaskError naming `source`."""
    from hf_fedtask.model.backbone import load_classifier, resolve_base_model

    if os.path.isabs(base_id) and not os.path.isdir(base_id):
        raise FedTaskError(f"{source}: base model folder {base_id!r} does not exist on this machine")
    try:
        ref = resolve_base_model(base_id)
        return ref, load_classifier(ref, num_labels)
    except FedTaskError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise FedTaskError(f"{source}: base model {base_id!r} cannot be loaded here "
                           f"({' '.join(str(exc).split())[:200]})") from None
