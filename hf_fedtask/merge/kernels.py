"""The numba backend of the merges: which task vectors its kernels take, and how they reach them.

The torch paths (`streaming`, and plain torch ops elsewhere) read every input float from memory once
or more, then run a dozen elementwise torch ops, and each op costs about as much as the read itself.
The kernels (`fused_passes`: TIES, unify, weighted means, MaTU's sign agreement; `threshold_select`:
the top-k magnitude threshold) do all of an entry's work at once, over all N tasks, while the N
values are in the CPU cache, and split the flat index space over threads. They are compiled with
numba (no C of our own), read the task tensors in place through their data pointers (`void_ptr`,
`Plan`: no gather copy), and perform the same float operations in the same order as the torch path,
so their results are the torch path's bit for bit (`fused_passes` says where they may differ). The
torch paths stay as the reference (tests compare both on random inputs of odd sizes) and are used for
dtypes other than float32; tensors on an accelerator take the batched torch ops of `batched` (TIES, unify,
task arithmetic) or the torch paths (the rest).

Numba's on-disk cache (``cache=True``) watches only the file a kernel is defined in: after changing
`void_ptr` here, clear the cache (``__pycache__/*.nbi``, ``*.nbc``) so the kernels that inline it
are compiled again.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import numba
import numpy as np
import torch
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hf_fedtask.merge.streaming import Layout

BLOCK = 1 << 14  # entries of the flat space per parallel work item (a multiple of 8: whole mask bytes)


@intrinsic
def void_ptr(typingctx, address):
    """An integer address as a void* that numba.carray can view (the tensors' data_ptr)."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.intp), codegen


def supported(layout: Layout) -> bool:
    """Whether the kernels handle these vectors (float32 CPU tensors throughout; the torch path does
    the rest, on the vectors' device)."""
    return (layout.device.type == "cpu" and layout.dtype == torch.float32
            and all(d == torch.float32 for d in layout.dtypes.values()))


BACKENDS = ("auto", "numba", "torch")
BATCHED_BACKENDS = (*BACKENDS, "batched")  # TIES and unify also have `batched` (one stack of all tasks)


def use_kernels(backend: str, layout: Layout) -> bool:
    """Whether a merge runs these kernels: "numba" demands them, "auto" takes them where they apply,
    "torch" runs the reference path."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "numba" and layout.device.type != "cpu":
        raise ValueError(f"the numba backend takes CPU task vectors, got tensors on {layout.device}")
    if backend == "numba" and not supported(layout):
        dtype = next((d for d in layout.dtypes.values() if d != torch.float32), layout.dtype)
        raise ValueError(f"the numba backend takes float32 task vectors, got {dtype}")
    return backend == "numba" or (backend == "auto" and supported(layout))


def choose(backend: str, layout: Layout) -> str:
    """The path of a merge that has all three ("numba", "batched" or "torch"): "auto" takes the kernels
    where they apply, the batched torch ops (`batched`) on an accelerator, else the streaming torch path."""
    if backend not in BATCHED_BACKENDS:
        raise ValueError(f"backend must be one of {BATCHED_BACKENDS}, got {backend!r}")
    if backend == "batched" or (backend == "auto" and layout.device.type != "cpu"):
        return "batched"
    return "numba" if use_kernels(backend, layout) else "torch"


@contextmanager
def torch_threads():
    """Run kernels on as many threads as torch may use (the benchmarks' --threads, a recipe's cores).
    Numba's OpenMP layer shares libgomp with torch, and starting its pool resets the process's
    OpenMP thread count, so torch's is put back afterwards."""
    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


class Plan:
    """The flat space of a Layout cut into BLOCK-entry blocks of (key, start, stop) pieces, and each
    task's data pointer per key, as arrays a kernel takes. Holds the tensors it points into."""

    def __init__(self, layout: Layout, flats: Sequence[Mapping[str, torch.Tensor]]):
        self.keys = list(layout.numels)
        index = {k: j for j, k in enumerate(self.keys)}
        self._bind(flats)
        key, start, stop, flat, block = [], [], [], [], [0]
        for first, pieces in layout.chunks(BLOCK):
            for p in pieces:
                key.append(index[p.key])
                start.append(p.start)
                stop.append(p.stop)
                flat.append(first + p.offset)
            block.append(len(key))
        self.piece_key, self.piece_start, self.piece_stop, self.piece_flat, self.block = (
            np.array(a, dtype=np.int64) for a in (key, start, stop, flat, block))

    def _bind(self, flats: Sequence[Mapping[str, torch.Tensor]]) -> None:
        self.tensors = [[f[k].contiguous() for k in self.keys] for f in flats]  # keeps the pointers valid
        self.ptrs = np.array([[t.data_ptr() for t in row] for row in self.tensors], dtype=np.int64).reshape(
            len(flats), len(self.keys))

    def rebind(self, flats: Sequence[Mapping[str, torch.Tensor]]) -> Plan:
        """The same cut of the flat space over other task vectors of the same layout (the pieces are
        not recomputed: a stream of vectors pays for them once)."""
        other = copy.copy(self)
        other._bind(flats)
        return other

    @staticmethod
    def pointers(tensors: Sequence[torch.Tensor]) -> np.ndarray:
        return np.array([t.data_ptr() for t in tensors], dtype=np.int64)
