"""The task-vector file format: safetensors with a typed string header, read and checked at the trust boundary.

A file holds one :class:`~hf_fedtask.core.taskvector.TaskVector` as a plain safetensors tensor dict;
its header (safetensors' ``__metadata__``, str -> str) says what the tensors are: ``format`` and
``format_version``, then the fields of :func:`make_metadata` (base model, PEFT config hash, kind,
tasks, client, round, dtype). Reading is where untrusted bytes arrive, so nothing is unpickled and
:func:`validate` checks every upload before use: header, keys, shapes and dtypes against a template,
finite values.

Errors: :class:`hf_fedtask.errors.TaskVectorError` (one-line message naming the file and the key or
header field) is raised by :func:`read_file`, :func:`read_bytes`, :func:`validate` and
:func:`inspect_file` when the data is unreadable, truncated or corrupt, lacks the
``format``/``format_version`` header, has a header field that does not decode, does not match the
``expect`` header values (e.g. ``base_model``, ``peft_config_hash``), has keys missing or unexpected
versus the template, a shape or dtype that differs from the template, or NaN/Inf values.

Hand-written because safetensors stores untyped tensor dicts: it has no typed header fields and no
validation against a template.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from typing import Any, Mapping, Protocol

import safetensors
import safetensors.torch
import torch

from hf_fedtask.errors import TaskVectorError


class TensorsWithHeader(Protocol):
    """What `validate` reads of a task vector (`hf_fedtask.core.taskvector.TaskVector`, which builds on this
    module): its tensors by key, its raw header and its non-finite keys."""

    raw_metadata: Mapping[str, str]

    def __contains__(self, key: object) -> bool: ...
    def __iter__(self): ...
    def __getitem__(self, key: str) -> torch.Tensor: ...
    def nonfinite_keys(self) -> list[str]: ...


# The header's `format` value. It is the container module's path, written into every file since the
# first release: files on disk carry it, so it stays as it is wherever the code lives.
FORMAT = "hf_fedtask.core.taskvector"
FORMAT_VERSION = "1"
KINDS = ("delta", "absolute")


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
        return dtype_name(value)
    return json.dumps(value)


def decode_metadata(raw: Mapping[str, str]) -> dict[str, Any]:
    """A header decoded: ``task_ids`` as a list, ``round`` as an int, empty values as None
    (ValueError naming the field where one does not decode)."""
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


def file_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, str]:
    """The header written for `tensors`: `metadata` with ``format`` and ``format_version`` set, and
    ``dtype`` inferred from the tensors when it is missing."""
    header = dict(metadata)
    if not header.get("dtype"):
        header["dtype"] = ",".join(sorted({dtype_name(v.dtype) for v in tensors.values()}))
    header.update(format=FORMAT, format_version=FORMAT_VERSION)
    return header


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


def write_file(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], header: Mapping[str, str]) -> None:
    """Write atomically: to a temporary file in the same directory, fsync, then rename. A failed
    write leaves ``path`` as it was."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{secrets.token_hex(8)}"
    try:
        safetensors.torch.save_file(safetensors_ready(tensors), tmp, metadata=dict(header))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def file_bytes(tensors: Mapping[str, torch.Tensor], header: Mapping[str, str]) -> bytes:
    """The content of the file :func:`write_file` would write."""
    return safetensors.torch.save(safetensors_ready(tensors), metadata=dict(header))


def read_bytes(data: bytes, source: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, header) of safetensors bytes, unchecked; ``source`` names them in errors."""
    try:
        data = bytes(data)
        tensors = safetensors.torch.load(data)
        # safetensors.torch.load drops the header metadata; the (already validated) header is
        # an 8-byte little-endian length followed by JSON.
        (length,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
    except (safetensors.SafetensorError, OSError, ValueError, TypeError, struct.error) as exc:
        raise TaskVectorError(f"{source}: cannot read task vector: {_one_line(exc)}") from None
    return tensors, metadata


def read_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, header) of a safetensors file, unchecked."""
    source = os.fspath(path)
    try:
        with safetensors.safe_open(source, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (safetensors.SafetensorError, OSError, ValueError, TypeError) as exc:
        raise TaskVectorError(f"{source}: cannot read task vector: {_one_line(exc)}") from None
    return tensors, metadata


def validate(
    tv: TensorsWithHeader,
    *,
    source: str,
    template: Mapping[str, Any] | None = None,
    expect: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`TaskVectorError` unless ``tv`` is a well-formed, finite task vector matching
    ``template`` (key -> tensor, or key -> shape) and the header values in ``expect``."""
    header = tv.raw_metadata
    if header.get("format") != FORMAT:
        raise TaskVectorError(
            f"{source}: not a task vector: header 'format' is {header.get('format')!r}, expected {FORMAT!r}"
        )
    if header.get("format_version") != FORMAT_VERSION:
        raise TaskVectorError(
            f"{source}: unsupported header 'format_version' {header.get('format_version')!r}, "
            f"expected {FORMAT_VERSION!r}"
        )
    try:
        decode_metadata(header)
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
            shape, dtype = template_spec(ref)
            if tuple(tv[key].shape) != shape:
                raise TaskVectorError(f"{source}: key {key!r} has shape {tuple(tv[key].shape)}, expected {shape}")
            if dtype is not None and tv[key].dtype != dtype:
                raise TaskVectorError(
                    f"{source}: key {key!r} has dtype {dtype_name(tv[key].dtype)}, expected {dtype_name(dtype)}"
                )
    bad = tv.nonfinite_keys()
    if bad:
        raise TaskVectorError(f"{source}: key {bad[0]!r} has NaN or Inf values ({len(bad)} tensor(s) affected)")


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
                rows.append((key, str(tuple(t.shape)), dtype_name(t.dtype), str(t.numel())))
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


def template_spec(ref: Any) -> tuple[tuple[int, ...], torch.dtype | None]:
    """(shape, dtype) of a template entry: a tensor, or a bare shape (dtype None)."""
    if isinstance(ref, torch.Tensor):
        return tuple(ref.shape), ref.dtype
    return tuple(int(d) for d in ref), None


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the header spells it: ``float32``, ``bfloat16``..."""
    return str(dtype).removeprefix("torch.")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
