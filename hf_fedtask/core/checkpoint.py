"""Atomic, resumable checkpoints of the server state and of the clients' private stores.

One safetensors file per run holds every state vector (packed as `<name>::<key>`), every client
store vector (as `client/<id>/<name>::<key>`) and, in its header, the finished round, the run
fingerprint and the per-round history. A single file replaced with `os.replace` is all-or-nothing:
a run killed at any point resumes from the last finished round, server and clients in step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hf_fedtask.core.files import CHECKPOINT_FILE
from hf_fedtask.core.state import ClientStore, GlobalState
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.taskvector_file import make_metadata, validate
from hf_fedtask.core.wire import pack_vectors, unpack_vectors
from hf_fedtask.errors import OutputDirError, TaskVectorError

CLIENT_PREFIX = "client/"
TIMING = "seconds"  # the per-round wall-clock field of a history record


def _store_name(client_id: int, name: str) -> str:
    return f"{CLIENT_PREFIX}{client_id}/{name}"


def save_checkpoint(run_dir: Path, state: GlobalState, *, history: list[dict], fingerprint: str, base_model: str,
                    base_model_revision: str, peft_config_hash: str,
                    stores: dict[int, ClientStore] | None = None) -> Path:
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
        # wall-clock timings are kept apart, so that a resumed run's checkpoint equals an
        # uninterrupted one in every tensor and every header field but `timings`
        history=json.dumps([{k: v for k, v in h.items() if k != TIMING} for h in history]),
        timings=json.dumps([h.get(TIMING) for h in history]),
    )
    vectors = dict(state.vectors)
    for cid, store in (stores or {}).items():
        vectors.update({_store_name(cid, name): tv for name, tv in store.items()})
    pack_vectors(vectors).save(path, metadata=meta)
    return path


def load_checkpoint(run_dir: Path, *, fingerprint: str, template: GlobalState | Callable[[dict], GlobalState],
                    ) -> tuple[GlobalState, list[dict], dict[int, ClientStore]]:
    """Load and validate against `template`: the freshly initialised state of the same config, or a
    function of the checkpoint's scalars giving the layout of that round's state (a strategy whose
    state changes between phases). Returns (server state, history, client stores)."""
    path = Path(run_dir) / CHECKPOINT_FILE
    if not path.exists():
        raise OutputDirError(f"{run_dir}: nothing to resume (no {CHECKPOINT_FILE})")
    flat = TaskVector.load(path, expect={"run_fingerprint": fingerprint})
    meta = flat.metadata
    scalars = _json_field(meta, "scalars", path)
    history = _json_field(meta, "history", path)
    if callable(template):
        template = template(scalars)
    expected = pack_vectors(template.vectors)
    server_keys = [k for k in flat if not k.startswith(CLIENT_PREFIX)]
    if set(server_keys) == set(expected):
        server_keys = list(expected)  # template order: flattening and packing depend on key order
    server = TaskVector({k: flat[k] for k in server_keys}, flat.raw_metadata)
    validate(server, source=str(path), template=expected)
    state = GlobalState(round=int(meta["round"]), vectors=unpack_vectors(server), scalars=scalars)
    stores: dict[int, ClientStore] = {}
    for name, tv in unpack_vectors(TaskVector({k: v for k, v in flat.items() if k.startswith(CLIENT_PREFIX)})).items():
        cid, _, inner = name[len(CLIENT_PREFIX):].partition("/")
        stores.setdefault(int(cid), {})[inner] = tv
    timings = _json_field(meta, "timings", path) if "timings" in meta else []
    for record, seconds in zip(history, timings):
        if seconds is not None:
            record[TIMING] = seconds
    return state, history, stores


def _json_field(meta: dict, name: str, path: Path):
    try:
        return json.loads(meta[name])
    except KeyError:
        raise TaskVectorError(f"{path}: checkpoint header lacks {name!r}") from None
    except (TypeError, ValueError) as e:
        raise TaskVectorError(f"{path}: checkpoint header field {name!r} is not valid JSON ({e})") from None
