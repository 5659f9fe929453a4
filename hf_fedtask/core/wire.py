"""`ClientUpdate`: what a client sends, and its wire format.

An update is a set of named task vectors (e.g. `shared` and `head/<task>`), the number of training
samples per task, and scalar metrics. On the wire it is ONE safetensors blob whose keys are
`<vector>::<parameter key>` (see `pack_vectors`) and whose header carries the rest, so the server
validates it with the same checks as any task-vector file and never unpickles client data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.taskvector_file import make_metadata

SEPARATOR = "::"


def pack_vectors(vectors: dict[str, TaskVector]) -> TaskVector:
    """Several named task vectors as one flat TaskVector with keys `<name>::<key>`; an empty vector
    (e.g. no shared module under linear probing) travels as the key `<name>::` with no elements."""
    flat = {}
    for name, tv in vectors.items():
        if not len(tv):
            flat[f"{name}{SEPARATOR}"] = torch.zeros(0)
        flat.update({f"{name}{SEPARATOR}{k}": t for k, t in tv.items()})
    return TaskVector(flat)


def unpack_vectors(flat: TaskVector) -> dict[str, TaskVector]:
    """Inverse of `pack_vectors` (vector order and key order preserved)."""
    out: dict[str, dict] = {}
    for key, t in flat.items():
        name, _, inner = key.partition(SEPARATOR)
        entries = out.setdefault(name, {})
        if inner:
            entries[inner] = t
    return {name: TaskVector(d) for name, d in out.items()}


@dataclass
class ClientUpdate:
    client_id: int
    round: int
    vectors: dict[str, TaskVector]
    num_samples: dict[str, int]  # per task held by this client
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def total_samples(self) -> int:
        return sum(self.num_samples.values())

    def to_bytes(self, *, base_model: str, base_model_revision: str, peft_config_hash: str) -> bytes:
        flat = pack_vectors(self.vectors)
        meta = make_metadata(
            base_model=base_model,
            base_model_revision=base_model_revision,
            peft_config_hash=peft_config_hash,
            kind="delta",
            task_ids=sorted(self.num_samples),
            client_id=self.client_id,
            round=self.round,
            num_samples=json.dumps(self.num_samples, sort_keys=True),
            metrics=json.dumps(self.metrics, sort_keys=True),
            vectors=json.dumps(list(self.vectors)),
        )
        return flat.to_bytes(metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, *, templates: dict[str, TaskVector], expect: dict[str, str],
                   source: str) -> ClientUpdate:
        """Parse and validate: keys, shapes, dtypes and finiteness against `templates`, header fields
        against `expect`. Raises `TaskVectorError` naming `source` and the offending key."""
        flat = TaskVector.from_bytes(data, source=source, template=pack_vectors(templates), expect=expect)
        meta = flat.metadata
        vectors = unpack_vectors(flat)
        return cls(
            client_id=int(meta["client_id"]),
            round=int(meta["round"]),
            vectors=vectors,
            num_samples={k: int(v) for k, v in json.loads(meta["num_samples"]).items()},
            metrics=json.loads(meta["metrics"]),
        )
