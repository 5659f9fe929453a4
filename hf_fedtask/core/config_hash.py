"""The PEFT config hash: one short string that says whether two adapters have the same layout.

Task-vector headers carry it (``peft_config_hash``), so the server can refuse an upload made for a
different adapter before looking at its tensors. It must agree across machines and PEFT versions for
the same adapter, so the fields that only describe where or how a config was used are left out.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any, Mapping

# PeftConfig fields that differ between machines or runs without changing parameter shapes or
# semantics (paths, versions, train/inference switch, runtime-only options). Removed at any depth.
_MACHINE_LOCAL_FIELDS = frozenset(
    {
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "runtime_config",
        "peft_version",
        "auto_mapping",  # only filled in by save_pretrained for custom models
        "tokenizer_name_or_path",
        "tokenizer_kwargs",
        "prompt_tuning_init_state_dict_path",
        "cache_file",  # CorDA's SVD cache path
    }
)
# Fields PEFT turns into sets in __post_init__; saved JSON lists them in arbitrary order.
_SET_FIELDS = frozenset({"target_modules", "exclude_modules", "feedforward_modules"})


def peft_config_hash(config: Any) -> str:
    """First 16 hex chars of the sha256 of a PEFT config's canonical JSON.

    Accepts a ``peft.PeftConfig`` or its dict (e.g. a loaded ``adapter_config.json``). Machine-local
    fields (paths, revision, ``inference_mode``, PEFT version, runtime options) are dropped and set-
    valued fields sorted, so clients with the same adapter layout agree on the hash.
    """
    as_dict = config if isinstance(config, Mapping) else config.to_dict()
    canonical = json.dumps(_canonical(as_dict), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _canonical(value: Any, field: str | None = None) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _canonical(v, str(k)) for k, v in value.items() if k not in _MACHINE_LOCAL_FIELDS}
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, (set, frozenset)) or (field in _SET_FIELDS and isinstance(value, (list, tuple))):
        return sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value
