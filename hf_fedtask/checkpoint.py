"""Atomic, resumable checkpoints of the server state.

One safetensors file per run holds every state vector (packed as `<name>::<key>`) and, in its
header, the finished round, the run fingerprint and the per-round history. A single file replaced
with `os.replace` is all-or-nothing: a run killed at any point resumes from the last finished round.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import OutputDirError
from .strategies.base import GlobalState
from .taskvector import TaskVector, make_metadata
from .update import pack_vectors, unpack_vectors

CHECKPOINT_FILE = "checkpoint.safetensors"


def save_checkpoint(run_dir: Path, state: GlobalState, *, history: list[dict], fingerprint: str, base_model: str,
                    base_model_revision: str, peft_config_hash: str) -> Path:
    path = Path(run_dir) / CHECKPOINT_FILE
    meta = make_metadata(
        base_model=base_model,
        base_model_revision=base_model_revision,
        peft_config_hash=peft_config_hash,
        kind="absolute",
        task_ids=[],
        round=state.round,
        run_fingerprint=fingerprint,
        scalars=json.dumps(state.scalars),
        history=json.dumps(history),
    )
    pack_vectors(state.vectors).save(path, metadata=meta)
    return path


def load_checkpoint(run_dir: Path, *, fingerprint: str, template: GlobalState) -> tuple[GlobalState, list[dict]]:
    """Load and validate against the freshly initialised `template` state of the same config."""
    path = Path(run_dir) / CHECKPOINT_FILE
    if not path.exists():
        raise OutputDirError(f"{run_dir}: nothing to resume (no {CHECKPOINT_FILE})")
    flat = TaskVector.load(path, template=pack_vectors(template.vectors), expect={"run_fingerprint": fingerprint})
    meta = flat.metadata
    state = GlobalState(round=int(meta["round"]), vectors=unpack_vectors(flat), scalars=json.loads(meta["scalars"]))
    return state, json.loads(meta["history"])
