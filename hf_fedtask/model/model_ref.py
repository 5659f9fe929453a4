"""How a base model is named portably (`BaseModelRef`: where it loads from, the Hub id exports record, the
revision) and how its weights are pinned (`file_sha256`). The model-loading modules build on it: the
Hub-cache writer (`hf_fedtask.model.hub_cache`), the embedded LLM (`hf_fedtask.model.embedded_llm`) and
the base-model resolver (`hf_fedtask.model.backbone`). It imports nothing heavy: `RunConfig` imports it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class BaseModelRef:
    """Where to load a base model from, and how to name it portably."""

    load_path: str  # what from_pretrained receives: a local folder or a Hub id
    model_id: str  # portable name recorded in adapter_config.json and task-vector headers
    revision: str  # a revision, or "sha256:<hash>" of the weights file when known


@cache
def _sha256(path: str, size: int, mtime: float) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file, memoised on (path, size, mtime) so repeated runs in one process are free."""
    st = os.stat(path)
    return _sha256(str(path), st.st_size, st.st_mtime)
