"""Task vectors: the PEFT parameters (or their change) a federated client sends, as safetensors.

A :class:`TaskVector` is an ordered mapping from PEFT's *saved* parameter name (adapter name removed,
as returned by ``peft.get_peft_model_state_dict``) to a tensor. ``kind="delta"`` vectors hold
``finetuned - initial``; ``kind="absolute"`` vectors hold the parameters themselves.

Files are safetensors with string metadata in the header (see :func:`make_metadata`). Loading is a
trust boundary: the server never unpickles and validates every upload before use.

Errors: :class:`hf_fedtask.errors.TaskVectorError` (one-line message naming the file and the key or
header field) is raised by :meth:`TaskVector.load`, :meth:`TaskVector.from_bytes`, :func:`validate`
and :func:`inspect_file` when the data is unreadable, truncated or corrupt, lacks the
``format``/``format_version`` header, has a header field that does not decode, does not match the
``expect`` header values (e.g. ``base_model``, ``peft_config_hash``), has keys missing or unexpected
versus the template, a shape or dtype that differs from the template, or NaN/Inf values.
Programming errors (mismatched keys in arithmetic, bad arguments) raise ``ValueError``/``TypeError``.

Hand-written because safetensors stores untyped tensor dicts and PEFT has no task-vector container:
neither offers arithmetic over PEFT state dicts, typed header metadata, nor template validation.
"""

from __future__ import annotations

import collections.abc
import enum
import hashlib
import json
import math
import numbers
import os
import secrets
import struct
from collections.abc import ItemsView, KeysView, ValuesView
from typing import Any, Callable, Iterator, Mapping

import safetensors
import safetensors.torch
import torch

from hf_fedtask.errors import TaskVectorError

FORMAT = "hf_fedtask.core.taskvector"
FORMAT_VERSION = "1"
KINDS = ("delta", "absolute")

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
        return _decode_metadata(self._metadata)

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
        return [k for k, v in self.items() if not torch.isfinite(v).all()]

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
        specs = {k: _spec(v) for k, v in template.items()}
        sizes = [math.prod(shape) for shape, _ in specs.values()]
        if flat.dim() != 1 or flat.numel() != sum(sizes):
            raise ValueError(f"flat tensor of shape {tuple(flat.shape)} does not match the template's {sum(sizes)} elements")
        pieces = torch.split(flat, sizes)
        return cls(
            {
                k: piece.reshape(shape) if dtype is None else piece.reshape(shape).to(dtype)
                for (k, (shape, dtype)), piece in zip(specs.items(), pieces)
            }
        )

    # Serialization
    def _header(self, metadata: Mapping[str, str] | None) -> dict[str, str]:
        header = dict(self._metadata if metadata is None else metadata)
        if not header.get("dtype"):
            header["dtype"] = ",".join(sorted({_dtype_name(v.dtype) for v in self.values()}))
        header.update(format=FORMAT, format_version=FORMAT_VERSION)
        return header

    def _serializable(self) -> dict[str, torch.Tensor]:
        return safetensors_ready(self)

    def save(self, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
        """Write atomically: to a temporary file in the same directory, fsync, then rename.

        ``metadata`` (str -> str, see :func:`make_metadata`) replaces this vector's own; ``format``,
        ``format_version`` and a missing ``dtype`` are filled in. A failed save leaves ``path`` as it was.
        """
        path = os.fspath(path)
        tmp = f"{path}.tmp-{secrets.token_hex(8)}"
        try:
            safetensors.torch.save_file(self._serializable(), tmp, metadata=self._header(metadata))
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def to_bytes(self, metadata: Mapping[str, str] | None = None) -> bytes:
        """The safetensors file content, with the header filled in as in :meth:`save`."""
        return safetensors.torch.save(self._serializable(), metadata=self._header(metadata))

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
        try:
            data = bytes(data)
            tensors = safetensors.torch.load(data)
            # safetensors.torch.load drops the header metadata; the (already validated) header is
            # an 8-byte little-endian length followed by JSON.
            (length,) = struct.unpack("<Q", data[:8])
            metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
        except (safetensors.SafetensorError, OSError, ValueError, TypeError, struct.error) as exc:
            raise TaskVectorError(f"{source}: cannot read task vector: {_one_line(exc)}") from None
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
        source = os.fspath(path)
        try:
            with safetensors.safe_open(source, framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (safetensors.SafetensorError, OSError, ValueError, TypeError) as exc:
            raise TaskVectorError(f"{source}: cannot read task vector: {_one_line(exc)}") from None
        return _checked(tensors, metadata, source, template, expect)


def safetensors_ready(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors with no shared storage: what safetensors accepts (it refuses
    non-contiguous tensors and tensors sharing memory, e.g. tied weights), as peft's saver prepares them."""
    out, storages = {}, set()
    for k, v in tensors.items():
        v = v.detach().cpu().contiguous()
        storage = v.untyped_storage().data_ptr()
        out[k] = v.clone() if storage in storages else v
        storages.add(storage)
    return out


def _checked(tensors, metadata, source, template, expect) -> TaskVector:
    if not all(isinstance(v, str) for v in metadata.values()):
        raise TaskVectorError(f"{source}: header metadata values must be strings")
    order = list(template) if template is not None and set(template) == set(tensors) else sorted(tensors)
    tv = TaskVector({k: tensors[k] for k in order}, metadata)
    validate(tv, source=source, template=template, expect=expect)
    return tv


def validate(
    tv: TaskVector,
    *,
    source: str,
    template: Mapping[str, Any] | None = None,
    expect: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`TaskVectorError` unless ``tv`` is a well-formed, finite task vector matching
    ``template`` (key -> tensor, or key -> shape) and the header values in ``expect``."""
    header = tv.raw_metadata
    if header.get("format") != FORMAT:
        raise TaskVectorError(f"{source}: not a task vector: header 'format' is {header.get('format')!r}, expected {FORMAT!r}")
    if header.get("format_version") != FORMAT_VERSION:
        raise TaskVectorError(
            f"{source}: unsupported header 'format_version' {header.get('format_version')!r}, expected {FORMAT_VERSION!r}"
        )
    try:
        _decode_metadata(header)
    except ValueError as exc:
        raise TaskVectorError(f"{source}: {exc}") from None
    for field, expected in (expect or {}).items():
        if header.get(field) != _encode(expected):
            raise TaskVectorError(
                f"{source}: header {field!r} mismatch: expected {_encode(expected)!r}, found {header.get(field)!r}"
            )
    if template is not None:
        for key in template:
            if key not in tv:
                raise TaskVectorError(f"{source}: key {key!r} is missing (the template has it)")
        for key in tv:
            if key not in template:
                raise TaskVectorError(f"{source}: unexpected key {key!r} (not in the template)")
        for key, ref in template.items():
            shape, dtype = _spec(ref)
            if tuple(tv[key].shape) != shape:
                raise TaskVectorError(f"{source}: key {key!r} has shape {tuple(tv[key].shape)}, expected {shape}")
            if dtype is not None and tv[key].dtype != dtype:
                raise TaskVectorError(
                    f"{source}: key {key!r} has dtype {_dtype_name(tv[key].dtype)}, expected {_dtype_name(dtype)}"
                )
    bad = tv.nonfinite_keys()
    if bad:
        raise TaskVectorError(f"{source}: key {bad[0]!r} has NaN or Inf values ({len(bad)} tensor(s) affected)")


def make_metadata(
    *,
    base_model: str,
    base_model_revision: str,
    peft_config_hash: str,
    kind: str,
    task_ids: list[str],
    client_id: str | None = None,
    round: int | None = None,
    dtype: torch.dtype | str | None = None,
    **extra: Any,
) -> dict[str, str]:
    """The safetensors header (str -> str) of a task-vector file.

    ``base_model_revision`` is a Hub revision or a content hash of the base weights. Lists and ints
    are JSON-encoded, None becomes ``""``; :attr:`TaskVector.metadata` decodes the standard fields
    (``extra`` values come back as their encoded strings). ``dtype=None`` is inferred at save time.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(task_ids, str):
        raise TypeError("task_ids must be a list of task names, not a string")
    fields = dict(
        base_model=base_model,
        base_model_revision=base_model_revision,
        peft_config_hash=peft_config_hash,
        kind=kind,
        task_ids=list(task_ids),
        client_id=client_id,
        round=round,
        **({} if dtype is None else {"dtype": dtype}),
        **extra,
    )
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **{k: _encode(v) for k, v in fields.items()}}


def _encode(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    return json.dumps(value)


def _decode_metadata(raw: Mapping[str, str]) -> dict[str, Any]:
    decoded: dict[str, Any] = dict(raw)
    if "task_ids" in raw:
        try:
            task_ids = json.loads(raw["task_ids"])
        except ValueError:
            task_ids = None
        if not isinstance(task_ids, list):
            raise ValueError(f"header 'task_ids' is not a JSON list: {raw['task_ids']!r}")
        decoded["task_ids"] = task_ids
    if raw.get("round"):
        try:
            decoded["round"] = int(raw["round"])
        except ValueError:
            raise ValueError(f"header 'round' is not an integer: {raw['round']!r}") from None
    for field in ("client_id", "round", "dtype"):
        if raw.get(field) == "":
            decoded[field] = None
    return decoded


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


def inspect_file(path: str | os.PathLike) -> str:
    """Human-readable report of a task-vector file: header, per-tensor table, totals and L2 norm.

    Shows whatever the file holds (no template); tensors are read one at a time for the norm.
    """
    source = os.fspath(path)
    rows, total, sq_norm, nonfinite = [], 0, 0.0, []
    try:
        size = os.path.getsize(source)
        with safetensors.safe_open(source, framework="pt") as f:
            metadata = f.metadata() or {}
            for key in f.keys():
                t = f.get_tensor(key)
                rows.append((key, str(tuple(t.shape)), _dtype_name(t.dtype), str(t.numel())))
                total += t.numel()
                sq_norm += torch.linalg.vector_norm(t, dtype=torch.float64).item() ** 2
                if not torch.isfinite(t).all():
                    nonfinite.append(key)
    except (safetensors.SafetensorError, OSError, ValueError, TypeError) as exc:
        raise TaskVectorError(f"{source}: cannot read task vector: {_one_line(exc)}") from None

    lines = [f"file: {source}", "metadata:"]
    shown = {k: v if len(v) <= 160 else f"{v[:120]}... ({len(v)} characters)" for k, v in metadata.items()}
    lines += [f"  {k}: {v}" for k, v in sorted(shown.items())] or ["  (none)"]
    header = ("key", "shape", "dtype", "numel")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    lines.append(
        f"tensors: {len(rows)}  parameters: {total}  file size: {size} bytes  L2 norm: {sq_norm ** 0.5:.6g}"
    )
    if nonfinite:
        lines.append(f"non-finite tensors: {', '.join(nonfinite)}")
    return "\n".join(lines)


def _spec(ref: Any) -> tuple[tuple[int, ...], torch.dtype | None]:
    """(shape, dtype) of a template entry: a tensor, or a bare shape."""
    if isinstance(ref, torch.Tensor):
        return tuple(ref.shape), ref.dtype
    return tuple(int(d) for d in ref), None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
