"""Task vectors: the PEFT parameters (or their change) a federated client sends.

A :class:`TaskVector` is an ordered mapping from PEFT's *saved* parameter name (adapter name removed,
as returned by ``peft.get_peft_model_state_dict``) to a tensor. ``kind="delta"`` vectors hold
``finetuned - initial``; ``kind="absolute"`` vectors hold the parameters themselves. The container
does the arithmetic the strategies and merges need, and saves and loads itself as a task-vector file
(`hf_fedtask.core.taskvector_file`: the header, validation at the trust boundary, ``inspect_file``);
the header's ``peft_config_hash`` comes from `hf_fedtask.core.config_hash`.

Errors: :meth:`TaskVector.load` and :meth:`TaskVector.from_bytes` raise
:class:`hf_fedtask.errors.TaskVectorError` for data that is unreadable or fails validation (see
`hf_fedtask.core.taskvector_file`). Programming errors (mismatched keys in arithmetic, bad
arguments) raise ``ValueError``/``TypeError``.

Hand-written because PEFT has no task-vector container: nothing offers arithmetic over PEFT state
dicts with the file's typed header beside them.
"""

from __future__ import annotations

import collections.abc
import math
import numbers
import os
from collections.abc import ItemsView, KeysView, ValuesView
from typing import Any, Callable, Iterator, Mapping

import torch

from hf_fedtask.core.taskvector_file import (
    decode_metadata,
    file_bytes,
    file_header,
    read_bytes,
    read_file,
    template_spec,
    validate,
    write_file,
)
from hf_fedtask.errors import TaskVectorError


def all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN and no Inf, from its min and max (one reduction, which a NaN or an Inf reaches):
    `torch.isfinite(t).all()` writes a boolean tensor of t's size first, up to 100x slower on a busy CPU."""
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    if t.is_complex():
        return all_finite(torch.view_as_real(t))
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low) & torch.isfinite(high))


class TaskVector(collections.abc.Mapping[str, torch.Tensor]):
    """Ordered ``saved PEFT parameter name -> tensor`` mapping with arithmetic and safetensors I/O.

    Tensors are stored as given and treated as immutable; every operation returns a new vector.
    Derived vectors (arithmetic, ``apply``, ``filter``, ``to``...) carry no metadata, since the
    header describes one upload (client, round, dtype); only :meth:`clone` copies it.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None):
        for key, value in tensors.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise TypeError(f"TaskVector entries must be str -> torch.Tensor, got {key!r}: {type(value).__name__}")
        for key, value in (metadata or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"TaskVector metadata must be str -> str (see make_metadata), got {key!r}: {value!r}")
        self._tensors = dict(tensors)
        self._metadata = dict(metadata or {})

    # Mapping protocol
    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    # The dict's own views: Mapping's defaults call __getitem__ once per key in Python, which a merge
    # of thousands of LoRA tensors feels (read-only all the same: a dict view cannot be assigned to)
    def keys(self) -> KeysView[str]:
        return self._tensors.keys()

    def items(self) -> ItemsView[str, torch.Tensor]:
        return self._tensors.items()

    def values(self) -> ValuesView[torch.Tensor]:
        return self._tensors.values()

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __repr__(self) -> str:
        return f"TaskVector({len(self)} tensors, {self.numel()} parameters)"

    # Metadata
    @property
    def raw_metadata(self) -> dict[str, str]:
        """The header as stored: str -> str."""
        return dict(self._metadata)

    @property
    def metadata(self) -> dict[str, Any]:
        """The header decoded: ``task_ids`` as a list, ``round`` as an int, empty values as None."""
        return decode_metadata(self._metadata)

    # Arithmetic
    def _zip(self, other: TaskVector, fn: Callable[[torch.Tensor, torch.Tensor], Any]) -> dict[str, Any]:
        if self.keys() != other.keys():
            first = next(k for k in [*self, *other] if k not in self or k not in other)
            raise ValueError(f"task vectors have different keys: {first!r} is only in one of them")
        return {k: fn(v, other[k]) for k, v in self.items()}

    def __add__(self, other: TaskVector) -> TaskVector:
        if not isinstance(other, TaskVector):
            return NotImplemented
        return TaskVector(self._zip(other, torch.add))

    def __radd__(self, other: Any) -> TaskVector:
        # sum() starts from 0
        if isinstance(other, numbers.Number) and other == 0:
            return TaskVector(self._tensors)
        return NotImplemented

    def __sub__(self, other: TaskVector) -> TaskVector:
        if not isinstance(other, TaskVector):
            return NotImplemented
        return TaskVector(self._zip(other, torch.sub))

    def __neg__(self) -> TaskVector:
        return self.apply(torch.neg)

    def __mul__(self, other: Any) -> TaskVector:
        """A scalar multiple, or the entrywise (Hadamard) product with a vector of the same keys."""
        if isinstance(other, TaskVector):
            return TaskVector(self._zip(other, torch.mul))
        if not isinstance(other, numbers.Number):
            return NotImplemented
        return self.apply(lambda t: t * other)

    __rmul__ = __mul__

    def __truediv__(self, scalar: Any) -> TaskVector:
        if not isinstance(scalar, numbers.Number):
            return NotImplemented
        return self.apply(lambda t: t / scalar)

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TaskVector:
        """A new vector with ``fn`` applied to every tensor."""
        return TaskVector({k: fn(v) for k, v in self.items()})

    def sign(self) -> TaskVector:
        return self.apply(torch.sign)

    def abs(self) -> TaskVector:
        return self.apply(torch.abs)

    def zeros_like(self) -> TaskVector:
        return self.apply(torch.zeros_like)

    def clone(self) -> TaskVector:
        """A deep copy, metadata included."""
        return TaskVector({k: v.clone() for k, v in self.items()}, self._metadata)

    def to(self, dtype: torch.dtype) -> TaskVector:
        return self.apply(lambda t: t.to(dtype))

    def filter(self, predicate: Callable[[str], bool]) -> TaskVector:
        """The sub-vector of the keys for which ``predicate(key)`` is true."""
        return TaskVector({k: v for k, v in self.items() if predicate(k)})

    # Reductions (accumulated in float64 so low-precision vectors do not lose accuracy)
    def norm(self, p: float = 2) -> float:
        """Global p-norm over all entries, as if flattened (p > 0, or ``float('inf')``)."""
        if not p > 0:
            raise ValueError(f"norm order must be positive, got {p}")
        if not self:
            return 0.0
        norms = torch.stack([torch.linalg.vector_norm(v, p, dtype=torch.float64) for v in self.values()])
        return torch.linalg.vector_norm(norms, p).item()

    def dot(self, other: TaskVector) -> float:
        """Inner product over all entries; keys must match."""
        return sum(self._zip(other, lambda a, b: (a.double() * b.double()).sum().item()).values(), 0.0)

    def numel(self) -> int:
        return sum(v.numel() for v in self.values())

    def is_finite(self) -> bool:
        return not self.nonfinite_keys()

    def nonfinite_keys(self) -> list[str]:
        """Keys whose tensor holds a NaN or an Inf."""
        return [k for k, v in self.items() if not all_finite(v)]

    # Flat view
    def flatten(self) -> torch.Tensor:
        """All entries concatenated in key order as one 1-D tensor (mixed dtypes are promoted)."""
        if not self:
            return torch.empty(0)
        return torch.cat([v.reshape(-1) for v in self.values()])

    @classmethod
    def unflatten(cls, flat: torch.Tensor, template: Mapping[str, Any]) -> TaskVector:
        """Inverse of :meth:`flatten`: split ``flat`` by the template's keys and shapes.

        ``template`` maps key -> tensor (its shape and dtype are used, so a mixed-dtype vector round
        trips exactly) or key -> shape (``flat``'s dtype is kept). Entries may be views of ``flat``.
        """
        specs = {k: template_spec(v) for k, v in template.items()}
        sizes = [math.prod(shape) for shape, _ in specs.values()]
        if flat.dim() != 1 or flat.numel() != sum(sizes):
            raise ValueError(f"flat tensor of shape {tuple(flat.shape)} does not match the template's "
                             f"{sum(sizes)} elements")
        pieces = torch.split(flat, sizes)
        return cls(
            {
                k: piece.reshape(shape) if dtype is None else piece.reshape(shape).to(dtype)
                for (k, (shape, dtype)), piece in zip(specs.items(), pieces)
            }
        )

    # Serialization: the task-vector file format (`hf_fedtask.core.taskvector_file`)
    def _header(self, metadata: Mapping[str, str] | None) -> dict[str, str]:
        return file_header(self, self._metadata if metadata is None else metadata)

    def save(self, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
        """Write atomically: to a temporary file in the same directory, fsync, then rename.

        ``metadata`` (str -> str, see `taskvector_file.make_metadata`) replaces this vector's own; ``format``,
        ``format_version`` and a missing ``dtype`` are filled in. A failed save leaves ``path`` as it was.
        """
        write_file(path, self, self._header(metadata))

    def to_bytes(self, metadata: Mapping[str, str] | None = None) -> bytes:
        """The safetensors file content, with the header filled in as in :meth:`save`."""
        return file_bytes(self, self._header(metadata))

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        source: str = "<bytes>",
        template: Mapping[str, Any] | None = None,
        expect: Mapping[str, Any] | None = None,
    ) -> TaskVector:
        """Parse and :func:`validate` safetensors bytes; ``source`` names them in errors."""
        tensors, metadata = read_bytes(data, source)
        return _checked(tensors, metadata, source, template, expect)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        template: Mapping[str, Any] | None = None,
        expect: Mapping[str, Any] | None = None,
    ) -> TaskVector:
        """Read and :func:`validate` a task-vector file. Keys come in template order, else sorted."""
        tensors, metadata = read_file(path)
        return _checked(tensors, metadata, os.fspath(path), template, expect)


def _checked(tensors, metadata, source, template, expect) -> TaskVector:
    if not all(isinstance(v, str) for v in metadata.values()):
        raise TaskVectorError(f"{source}: header metadata values must be strings")
    order = list(template) if template is not None and set(template) == set(tensors) else sorted(tensors)
    tv = TaskVector({k: tensors[k] for k in order}, metadata)
    validate(tv, source=source, template=template, expect=expect)
    return tv
