"""Chunked passes over N task vectors at once, so that server-side merges never stack N vectors.

A merge walks the flat index space of the vectors (the order of `TaskVector.flatten`) in chunks.
Each chunk of all N tasks is gathered into an N×C scratch buffer sized to stay in the CPU cache, so
every input float is read from memory once however many passes the merge then makes over the
chunk, and the batched operations over the buffer keep torch's per-call overhead small even for
vectors made of many small tensors. Memory is the outputs (O(d)) plus O(N·C) scratch.

Chunks start at multiples of 8, so per-chunk bit-packed masks concatenate into one mask over the
flat vector (numpy's `packbits` layout, as `bitmask` defines it).

Vectors on an accelerator (all on one device) stream the same way there, in larger chunks
(`DEVICE_BYTES`): the merges then run their torch paths on that device and return results there.

Written here because neither torch nor peft has a chunked multi-tensor pass over dicts of tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce

import torch

# Bytes of one chunk of all N tasks. The merges keep two or three such buffers, which must stay in
# the last-level cache beside the inputs streaming through it (the sizes compared:
# benchmarks/merge_bench.py).
CACHE_BYTES = 4 << 20
MAX_CHUNK = 1 << 20  # entries per row when there are only a few tasks
# On an accelerator there is no cache to fit: chunks only bound the scratch memory and the number of
# kernel launches. At most 2^22 entries a row keeps sign_similarity's float32 Gram counts exact.
DEVICE_BYTES = 64 << 20
MAX_DEVICE_CHUNK = 1 << 22


def chunk_len(n_rows: int, itemsize: int, numel: int, device: torch.device | None = None) -> int:
    """Entries per chunk for `n_rows` rows of `itemsize` bytes over `numel` entries: a multiple of
    8, at least 8, no more than `numel` needs (larger on a `device` other than the CPU)."""
    on_cpu = device is None or device.type == "cpu"
    budget, most = (CACHE_BYTES, MAX_CHUNK) if on_cpu else (DEVICE_BYTES, MAX_DEVICE_CHUNK)
    fits = min(most, budget // (max(n_rows, 1) * itemsize), numel + 7)
    return max(8, fits // 8 * 8)


@dataclass(frozen=True)
class Piece:
    """The part of one key in a chunk: key-local flat entries [start, stop) land at chunk[offset:]."""

    key: str
    start: int
    stop: int
    offset: int

    @property
    def chunk_slice(self) -> slice:
        return slice(self.offset, self.offset + self.stop - self.start)


class Layout:
    """Keys, shapes and dtypes of N compatible task vectors, and the chunks of their flat space.

    `dtype` is the promotion of every key's dtype over all vectors: merges compute in it and write
    each key back in its own dtype, which for the usual single-dtype vectors changes nothing.
    `device` is where the tensors are, one device for all (the first vector's tensors and each other
    vector's first tensor are checked, else ValueError; the CPU when there are none): outputs and
    scratch buffers are made there."""

    def __init__(self, vectors: Sequence[Mapping[str, torch.Tensor]]):
        template = vectors[0]
        self.shapes = {k: v.shape for k, v in template.items()}
        self.dtypes = {k: v.dtype for k, v in template.items()}
        self.numels = {k: v.numel() for k, v in template.items()}
        self.numel = sum(self.numels.values())
        dtypes = {t.dtype for tv in vectors for t in tv.values()}
        devices = {t.device for t in template.values()}  # O(keys + vectors): `.device` is slow to read
        devices.update(next(iter(tv.values())).device for tv in vectors[1:] if len(tv))
        if len(devices) > 1:
            raise ValueError(f"task vectors on different devices ({', '.join(sorted(map(str, devices)))}): "
                             "move them to one device first")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.dtype = reduce(torch.promote_types, dtypes) if dtypes else torch.float32

    def chunks(self, size: int) -> Iterator[tuple[int, list[Piece]]]:
        """(flat start, pieces) of consecutive chunks of `size` entries (the last may be shorter)."""
        pieces: list[Piece] = []
        filled, start = 0, 0
        for key, numel in self.numels.items():
            pos = 0
            while pos < numel:
                take = min(numel - pos, size - filled)
                pieces.append(Piece(key, pos, pos + take, filled))
                pos += take
                filled += take
                if filled == size:
                    yield start, pieces
                    start, filled, pieces = start + size, 0, []
        if pieces:
            yield start, pieces

    def flat_views(self, tv: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each tensor as a 1-D view (a copy only for a non-contiguous tensor)."""
        return {k: tv[k].detach().reshape(-1) for k in self.numels}

    def empty_flat(self) -> dict[str, torch.Tensor]:
        """Uninitialized flat outputs, one per key in the key's own dtype, on the vectors' device."""
        return {k: torch.empty(n, dtype=self.dtypes[k], device=self.device) for k, n in self.numels.items()}

    def unflatten(self, flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: flat[k].reshape(shape) for k, shape in self.shapes.items()}


def gather(flats: Sequence[Mapping[str, torch.Tensor]], pieces: Sequence[Piece], out: torch.Tensor) -> torch.Tensor:
    """Copy the chunk described by `pieces` of each task (row t from flats[t]) into `out` (N×n)."""
    for row, flat in zip(out, flats):
        for p in pieces:
            row[p.chunk_slice].copy_(flat[p.key][p.start : p.stop])
    return out


def scatter(chunk: torch.Tensor, pieces: Sequence[Piece], out: Mapping[str, torch.Tensor]) -> None:
    """Write a merged chunk (n entries) back into the flat per-key outputs."""
    for p in pieces:
        out[p.key][p.start : p.stop].copy_(chunk[p.chunk_slice])
