"""Fused merge kernels: TIES, unify, weighted means, MaTU's sign agreement and the top-k magnitude
threshold, each in one compiled pass.

The torch paths (`streaming`, and plain torch ops elsewhere) read every input float from memory once
or more, then run a dozen elementwise torch ops, and each op costs about as much as the read itself.
These kernels do all of an entry's work at once, over all N tasks, while the N values are in the CPU
cache, and split the flat index space over threads. They are compiled with numba (no C of our own;
one movemask is spelled in LLVM IR, `_packbits32`), read the task tensors in place through their
data pointers (no gather copy), and perform the same float operations in the same order as the
torch path, so results are bit for bit the torch path's: `ties`' merged vector, `unify`'s vector and
masks (except that where unify's elected sign is 0 the torch path may write -0.0 and the kernel
+0.0), weighted means (float64 sums with torch's fused multiply-add) and the agreement mask. Only unify's rescaler sums are accumulated in another
order (vectorized float32 partial sums per SUB entries, added up in float64, where the torch path
sums float32 per cache-sized chunk), which moves a rescaler by at most a few float32 ulps. The torch
paths stay as the reference (tests compare both on random inputs of odd sizes) and are used for
dtypes other than float32.

The threshold selection (`kth_largest_abs`) needs no sort. A population of 2^16 entries or more is
read about once: a sample of 8-entry runs brackets the k-th largest |x|, and one pass counts the
entries above the bracket (a vectorized compare-and-count) and collects the 1-10% inside it from
the 8-entry groups that hold any, while they are in L1; the exact value is resolved among those.
Under 2^20 entries (a LoRA tensor), where the sample is small and its bracket wide, one counting pass
at 8 edges inside the bracket first narrows it, and the collection (a second read, from cache) keeps
the 1-2% between two edges. Smaller populations, and a bracket that misses, take the radix
selection: one pass histograms the high 12 bits of |x| (monotone in |x| for floats), a second
collects the one bin holding the k-th largest, and two more histogram levels over that bin give the
exact value. Populations (one per task, or per task and tensor) run in parallel.

The TIES and unify passes sweep 2 or 4 tasks at once over each cache-sized piece, so that one load
and store of a running sum or maximum serves several tasks, in task order (results unchanged).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from hf_fedtask.merge.streaming import Layout

BLOCK = 1 << 14  # entries of the flat space per parallel work item (a multiple of 8: whole mask bytes)
SUB = 1 << 12  # entries of one pass over all N tasks, kept in L2 between the passes (N=30, d=10M:
# 4096 measured 5-20% faster than 2048 or 8192: longer runs per input stream, still cache-resident)
_BINS1 = 1 << 12  # first and second histogram levels: 12 bits of |x| each (then 7)
_ABS = np.uint32(0x7FFFFFFF)
_SAMPLE = 1 << 16  # entries of the strided sample that brackets the k-th largest, at most
_SAMPLE_STRIDE_BITS = 6  # and at most one entry in 2^6
_SAMPLE_RUN = 8  # taken as runs of 8 consecutive entries (32 bytes): at the same density, 2.5x faster to
# read than single entries (each single entry costs a cache line; runs share the lines, measured)
_CHUNK = 1 << 12  # entries flagged, then collected, while in L1
_COUNT_FASTMATH = {"reassoc", "nsz", "arcp", "contract", "nnan", "ninf"}  # counts of 0/1 floats: exact in any order
_SAMPLED_FROM = 1 << 16  # populations at least this large take the sampled selection (2x radix's speed from here)
_COUNTED_BELOW = 1 << 20  # and those under this first narrow the bracket by counting at _EDGES edges: measured
# 0.62x the one-pass time at 2^16 entries, 0.81x at 2^18, 0.94x at 2^19, 1.03x at 2^20 (N(0,1), density 0.2)
_EDGES = 8


@intrinsic
def _void_ptr(typingctx, address):
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


@numba.njit(inline="always")
def _row(ptrs, t, k, s, m):
    """Task t's entries s..s+m of tensor k, read in place."""
    return numba.carray(_void_ptr(ptrs[t, k]), (s + m,), np.float32)[s:]


# -- TIES: trim, elect, disjoint mean -------------------------------------------------------------


@numba.njit(inline="always")
def _trimmed(x, cut):
    """torch.hardshrink(x, cut): 0 where -cut <= x <= cut, else x (branch-free, so loops vectorize)."""
    return np.float32(0.0) if (x >= -cut) & (x <= cut) else x


@numba.njit(inline="always")
def _sign(x):
    return np.float32(1.0) if x > 0 else (np.float32(-1.0) if x < 0 else np.float32(0.0))


@numba.njit(parallel=True, nogil=True, cache=True)
def _ties_kernel(ptrs, lambd, weights, frequency, out_ptrs, piece_key, piece_start, piece_stop, block):
    n_tasks = ptrs.shape[0]
    for b in prange(block.size - 1):
        vote = np.empty(SUB, np.float32)
        count = np.empty(SUB, np.float32)
        total = np.empty(SUB, np.float32)
        for p in range(block[b], block[b + 1]):
            k, s0, s1 = piece_key[p], piece_start[p], piece_stop[p]
            out = numba.carray(_void_ptr(out_ptrs[k]), (s1,), np.float32)
            for s in range(s0, s1, SUB):
                m = min(SUB, s1 - s)
                # the vote: Σ_t trimmed τ_t (or Σ_t of its signs), in task order, 2 tasks per sweep
                for t in range(0, n_tasks - 1, 2):
                    _vote2(_row(ptrs, t, k, s, m), _row(ptrs, t + 1, k, s, m), lambd[t, k], lambd[t + 1, k],
                           frequency, t == 0, vote, m)
                if n_tasks % 2:
                    t = n_tasks - 1
                    _vote1(_row(ptrs, t, k, s, m), lambd[t, k], frequency, t == 0, vote, m)
                for j in range(m):  # +1 where the vote is >= 0, else -1
                    vote[j] = np.float32(1.0) if vote[j] >= 0 else np.float32(-1.0)
                # the agreeing entries' weighted sum and their count, in task order, 2 tasks per sweep
                for t in range(0, n_tasks - 1, 2):
                    _disjoint2(_row(ptrs, t, k, s, m), _row(ptrs, t + 1, k, s, m), lambd[t, k], lambd[t + 1, k],
                               weights[t], weights[t + 1], t == 0, vote, count, total, m)
                if n_tasks % 2:
                    t = n_tasks - 1
                    _disjoint1(_row(ptrs, t, k, s, m), lambd[t, k], weights[t], t == 0, vote, count, total, m)
                o = out[s:]
                for j in range(m):
                    o[j] = total[j] / max(count[j], np.float32(1.0))


# Sweeps of 2 tasks at once: each load and store of the running vote, count and sum serves two tasks
# (the merge pass took 0.138 s against 0.164 s with one task per sweep, N=30, d=10M, 1 thread). The first
# sweep assigns where the later ones add, so every sum is taken in task order from the first task's
# value, as the torch path takes it: results are unchanged bit for bit, the sign of a zero included.


@numba.njit(nogil=True, cache=True, inline="never")
def _vote2(a, b, cut_a, cut_b, frequency, first, vote, m):
    if frequency and first:
        for j in range(m):
            vote[j] = _sign(_trimmed(a[j], cut_a)) + _sign(_trimmed(b[j], cut_b))
    elif frequency:
        for j in range(m):
            vote[j] = (vote[j] + _sign(_trimmed(a[j], cut_a))) + _sign(_trimmed(b[j], cut_b))
    elif first:
        for j in range(m):
            vote[j] = _trimmed(a[j], cut_a) + _trimmed(b[j], cut_b)
    else:
        for j in range(m):
            vote[j] = (vote[j] + _trimmed(a[j], cut_a)) + _trimmed(b[j], cut_b)


@numba.njit(nogil=True, cache=True, inline="never")
def _vote1(a, cut, frequency, first, vote, m):
    for j in range(m):
        x = _sign(_trimmed(a[j], cut)) if frequency else _trimmed(a[j], cut)
        vote[j] = x if first else vote[j] + x


@numba.njit(inline="always")
def _agreeing(a, cut, vote):
    """(x, 1 or 0): the trimmed entry and whether it agrees with the elected sign."""
    x = _trimmed(a, cut)
    return x, (np.float32(1.0) if x * vote > 0 else np.float32(0.0))


@numba.njit(nogil=True, cache=True, inline="never")
def _disjoint2(a, b, cut_a, cut_b, w_a, w_b, first, vote, count, total, m):
    if first:
        for j in range(m):
            xa, agree_a = _agreeing(a[j], cut_a, vote[j])
            xb, agree_b = _agreeing(b[j], cut_b, vote[j])
            count[j] = agree_a + agree_b
            total[j] = (xa * agree_a) * w_a + (xb * agree_b) * w_b
    else:
        for j in range(m):
            xa, agree_a = _agreeing(a[j], cut_a, vote[j])
            xb, agree_b = _agreeing(b[j], cut_b, vote[j])
            count[j] = (count[j] + agree_a) + agree_b
            total[j] = (total[j] + (xa * agree_a) * w_a) + (xb * agree_b) * w_b


@numba.njit(nogil=True, cache=True, inline="never")
def _disjoint1(a, cut, w, first, vote, count, total, m):
    for j in range(m):
        x, agree = _agreeing(a[j], cut, vote[j])
        count[j] = agree if first else count[j] + agree
        total[j] = (x * agree) * w if first else total[j] + (x * agree) * w


def ties_merge(plan: Plan, lambd: np.ndarray, weights: Sequence[float], frequency: bool,
               out: Mapping[str, torch.Tensor]) -> None:
    """TIES' trim (|x| > lambd[t, key] survives), election and disjoint mean into `out` (flat float32
    tensors per key, written in place)."""
    with torch_threads():
        _ties_kernel(plan.ptrs, lambd.astype(np.float32), np.asarray(weights, dtype=np.float32), frequency,
                     Plan.pointers([out[k] for k in plan.keys]), plan.piece_key, plan.piece_start, plan.piece_stop,
                     plan.block)


# -- weighted sums in float64, and MaTU's sign agreement ------------------------------------------


@numba.njit(parallel=True, nogil=True, cache=True, fastmath={"contract"})
def _add_scaled_kernel(ptrs, w, acc_ptrs, piece_key, piece_start, piece_stop, block):
    """acc += w·x, x widened to float64 entry by entry: torch's acc.add_(x.double(), alpha=w)
    without the float64 copy of x. "contract" lets LLVM fuse the multiply-add into one FMA, as
    torch's vectorized CPU kernel computes it (vec::fmadd), so both round once."""
    for b in prange(block.size - 1):
        for p in range(block[b], block[b + 1]):
            k, s0, s1 = piece_key[p], piece_start[p], piece_stop[p]
            x = numba.carray(_void_ptr(ptrs[0, k]), (s1,), np.float32)
            acc = numba.carray(_void_ptr(acc_ptrs[k]), (s1,), np.float64)
            for j in range(s0, s1):
                acc[j] += w * np.float64(x[j])


@numba.njit(parallel=True, nogil=True, cache=True, fastmath={"contract"})
def _weighted_mean_kernel(ptrs, weights, total, out_ptrs, piece_key, piece_start, piece_stop, block):
    """out = float32(Σ_t w_t·x_t / total), the sum in float64 over the tasks in order with the same
    FMA per term as `_add_scaled_kernel`, so it equals adding the tasks one by one, bit for bit; but
    the float64 sums live in an L1-sized chunk, so each input is read once and the mean written once."""
    n_tasks = ptrs.shape[0]
    for b in prange(block.size - 1):
        acc = np.empty(SUB, np.float64)
        for p in range(block[b], block[b + 1]):
            k, s0, s1 = piece_key[p], piece_start[p], piece_stop[p]
            out = numba.carray(_void_ptr(out_ptrs[k]), (s1,), np.float32)
            for s in range(s0, s1, SUB):
                m = min(SUB, s1 - s)
                acc[:m] = 0.0
                for t in range(n_tasks):
                    a, w = _row(ptrs, t, k, s, m), weights[t]
                    for j in range(m):
                        acc[j] += w * np.float64(a[j])
                o = out[s:]
                for j in range(m):
                    o[j] = np.float32(acc[j] / total)


def weighted_mean(plan: Plan, weights: Sequence[float], total: float, out: Mapping[str, torch.Tensor]) -> None:
    """out[key] = float32(Σ_t w_t·x_t[key] / total) over the plan's task vectors, in one pass."""
    with torch_threads():
        _weighted_mean_kernel(plan.ptrs, np.asarray(weights, dtype=np.float64), float(total),
                              Plan.pointers([out[k] for k in plan.keys]), plan.piece_key, plan.piece_start,
                              plan.piece_stop, plan.block)


@numba.njit(parallel=True, nogil=True, cache=True)
def _divide_kernel(acc_ptrs, total, out_ptrs, piece_key, piece_start, piece_stop, block):
    """out = float32(acc / total), rounded to nearest as torch's .to(float32) rounds."""
    for b in prange(block.size - 1):
        for p in range(block[b], block[b + 1]):
            k, s0, s1 = piece_key[p], piece_start[p], piece_stop[p]
            acc = numba.carray(_void_ptr(acc_ptrs[k]), (s1,), np.float64)
            out = numba.carray(_void_ptr(out_ptrs[k]), (s1,), np.float32)
            for j in range(s0, s1):
                out[j] = np.float32(acc[j] / total)


def add_scaled(plan: Plan, w: float, acc: Mapping[str, torch.Tensor]) -> None:
    """acc[key] += w·x[key] in float64 for the one task vector of `plan` (float32), in place."""
    with torch_threads():
        _add_scaled_kernel(plan.ptrs, float(w), Plan.pointers([acc[k] for k in plan.keys]), plan.piece_key,
                           plan.piece_start, plan.piece_stop, plan.block)


def divide(plan: Plan, acc: Mapping[str, torch.Tensor], total: float, out: Mapping[str, torch.Tensor]) -> None:
    """out[key] = float32(acc[key] / total) over the keys of `plan` (flat tensors)."""
    with torch_threads():
        _divide_kernel(Plan.pointers([acc[k] for k in plan.keys]), float(total), Plan.pointers([out[k] for k in plan.keys]),
                       plan.piece_key, plan.piece_start, plan.piece_stop, plan.block)


@numba.njit(parallel=True, nogil=True, cache=True)
def _agreement_kernel(ptrs, rho, out_ptrs, piece_key, piece_start, piece_stop, block):
    """α = |Σ_t sgn(τ_t)| / N (the count is a small integer: exact in float32), and the soft mask
    1 where α ≥ rho, else α."""
    n_tasks = ptrs.shape[0]
    for b in prange(block.size - 1):
        count = np.empty(SUB, np.float32)
        for p in range(block[b], block[b + 1]):
            k, s0, s1 = piece_key[p], piece_start[p], piece_stop[p]
            out = numba.carray(_void_ptr(out_ptrs[k]), (s1,), np.float32)
            for s in range(s0, s1, SUB):
                m = min(SUB, s1 - s)
                count[:m] = 0
                for t in range(n_tasks):
                    a = _row(ptrs, t, k, s, m)
                    for j in range(m):
                        count[j] += _sign(a[j])
                o = out[s:]
                for j in range(m):
                    alpha = abs(count[j]) / np.float32(n_tasks)
                    o[j] = np.float32(1.0) if alpha >= rho else alpha


def agreement(plan: Plan, rho: float, out: Mapping[str, torch.Tensor]) -> None:
    """MaTU's soft agreement mask of the plan's task vectors into `out` (flat float32 per key)."""
    with torch_threads():
        _agreement_kernel(plan.ptrs, np.float32(rho), Plan.pointers([out[k] for k in plan.keys]), plan.piece_key,
                          plan.piece_start, plan.piece_stop, plan.block)


# -- unify: sign, largest agreeing magnitude, masks, rescaler sums --------------------------------


@numba.njit(parallel=True, nogil=True, cache=True)
def _unify_kernel(ptrs, out_ptrs, mask_ptrs, sums, piece_key, piece_start, piece_stop, piece_flat, block):
    n_tasks = ptrs.shape[0]
    for b in prange(block.size - 1):
        sign = np.empty(SUB, np.float32)
        magnitude = np.empty(SUB, np.float32)
        # flags[t, lead + j]: entry j agrees with task t; lead aligns bytes to the flat space, and the
        # bytes around the m written ones stay 0 for the packing
        flags = np.zeros((n_tasks, SUB + 16), np.uint8)
        for p in range(block[b], block[b + 1]):
            k, s0, s1 = piece_key[p], piece_start[p], piece_stop[p]
            out = numba.carray(_void_ptr(out_ptrs[k]), (s1,), np.float32)
            for s in range(s0, s1, SUB):
                m = min(SUB, s1 - s)
                a = _row(ptrs, 0, k, s, m)
                for j in range(m):  # σ = sgn(Σ_t τ_t), summed in task order, 4 tasks per sweep
                    sign[j] = a[j]
                t = 1
                while t + 4 <= n_tasks:
                    _add4(_row(ptrs, t, k, s, m), _row(ptrs, t + 1, k, s, m), _row(ptrs, t + 2, k, s, m),
                          _row(ptrs, t + 3, k, s, m), sign, m)
                    t += 4
                for t in range(t, n_tasks):
                    _add1(_row(ptrs, t, k, s, m), sign, m)
                for j in range(m):
                    sign[j] = _sign(sign[j])
                    magnitude[j] = np.float32(0.0)
                flat0 = piece_flat[p] + (s - s0)
                lead = flat0 % 8
                n_bytes = (lead + m + 7) // 8
                t = 0
                # μ = max(0, max_t τ_t·σ), m_t = 1[τ_t·σ > 0] and Σ|τ_t|, 2 tasks per sweep
                while t + 2 <= n_tasks:
                    sums[p, 0, t], sums[p, 0, t + 1] = _agree2(
                        _row(ptrs, t, k, s, m), _row(ptrs, t + 1, k, s, m), sign, magnitude,
                        flags[t, lead:], flags[t + 1, lead:], m, sums[p, 0, t], sums[p, 0, t + 1])
                    t += 2
                if t < n_tasks:
                    sums[p, 0, t] += _agree(_row(ptrs, t, k, s, m), sign, magnitude, flags[t, lead:], m)
                o = out[s:]
                for j in range(m):
                    o[j] = sign[j] * magnitude[j]
                for t in range(n_tasks):  # m_t as packbits bits, and Σ|m_t ⊙ τ|
                    flags[t, :lead] = 0
                    flags[t, lead + m: n_bytes * 8] = 0
                    sums[p, 1, t] += _sum_where(magnitude, flags[t, lead:], m)
                    bits = numba.carray(_void_ptr(mask_ptrs[t]), ((flat0 - lead) // 8 + n_bytes,), np.uint8)
                    _pack_bits(bits[(flat0 - lead) // 8:], flags[t], n_bytes, lead > 0)


# The sweeps below take 2 or 4 tasks at once: each load and store of the running sum or maximum then
# serves several tasks (measured 15-20% off unify's time against one task per sweep; the sum is still
# taken in task order, and a max is exact in any order, so results are unchanged bit for bit).


@numba.njit(nogil=True, cache=True, inline="never")
def _add4(a, b, c, e, total, m):
    for j in range(m):
        total[j] = (((total[j] + a[j]) + b[j]) + c[j]) + e[j]


@numba.njit(nogil=True, cache=True, inline="never")
def _add1(a, total, m):
    for j in range(m):
        total[j] += a[j]


@numba.njit(nogil=True, cache=True, inline="never", fastmath={"reassoc"})
def _agree(a, sign, magnitude, flags, m):
    """With q = a·σ: magnitude = max(magnitude, q) and flags = 1[q > 0], in one read of a; returns
    Σ_j |a[j]| (float32 partial sums, in the compiler's vectorized order)."""
    total = np.float32(0.0)
    for j in range(m):
        q = a[j] * sign[j]
        magnitude[j] = np.maximum(magnitude[j], q)
        flags[j] = q > 0
        total += abs(a[j])
    return np.float64(total)


@numba.njit(nogil=True, cache=True, inline="never", fastmath={"reassoc"})
def _agree2(a, b, sign, magnitude, flags_a, flags_b, m, sum_a, sum_b):
    """`_agree` for two tasks in one sweep; returns sum_a + Σ|a| and sum_b + Σ|b|."""
    total_a, total_b = np.float32(0.0), np.float32(0.0)
    for j in range(m):
        qa, qb = a[j] * sign[j], b[j] * sign[j]
        magnitude[j] = np.maximum(np.maximum(magnitude[j], qa), qb)
        flags_a[j] = qa > 0
        flags_b[j] = qb > 0
        total_a += abs(a[j])
        total_b += abs(b[j])
    return sum_a + np.float64(total_a), sum_b + np.float64(total_b)


@numba.njit(nogil=True, cache=True, inline="never", fastmath={"reassoc"})
def _sum_where(values, keep, m):
    """Σ_j values[j]·keep[j] (keep 0 or 1, values finite; float32 partial sums, vectorized)."""
    total = np.float32(0.0)
    for j in range(m):
        total += values[j] * np.float32(keep[j])
    return np.float64(total)


@intrinsic
def _packbits32(typingctx, address):
    """The packbits form of the 32 flag bytes (each 0 or 1) at an integer address, as an integer
    whose little-endian bytes are the 4 packed bytes (the first flag of each 8 in bit 7): one vector
    compare and a movemask. Written as LLVM IR because numba has no spelling for a movemask."""

    def codegen(context, builder, signature, args):
        bytes32 = ir.VectorType(ir.IntType(8), 32)
        flags = builder.load(builder.inttoptr(args[0], bytes32.as_pointer()), align=1)
        msb_first = ir.Constant(ir.VectorType(ir.IntType(32), 32), [8 * (i // 8) + 7 - i % 8 for i in range(32)])
        flags = builder.shuffle_vector(flags, flags, msb_first)
        nonzero = builder.icmp_unsigned("!=", flags, ir.Constant(bytes32, [0] * 32))
        return builder.zext(builder.bitcast(nonzero, ir.IntType(32)), ir.IntType(64))

    return types.uint64(types.intp), codegen


@intrinsic
def _store32(typingctx, address, word):
    """Store the low 4 bytes of `word` at an integer address of any alignment (little-endian)."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        builder.store(builder.trunc(args[1], i32), builder.inttoptr(args[0], i32.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(types.intp, types.uint64), codegen


@numba.njit(inline="always")
def _packbits8(flags, i):
    """The packbits byte of the 8 flag bytes flags[8i:8i+8] (each 0 or 1): a multiply gathers the
    low bit of each little-endian byte into the top byte."""
    return np.uint8((flags[8 * i: 8 * i + 8].view(np.uint64)[0] * np.uint64(0x8040201008040201)) >> np.uint64(56))


@numba.njit(inline="always")
def _pack_bits(bits, flags, n_bytes, merge_first):
    """Write 0/1 bytes `flags` as packbits bytes (the first flag is bit 7 of bits[0]) to bits[:n_bytes],
    32 flags at a time by `_packbits32` and one 4-byte store; only bits[0] is OR-ed in, and only
    where `merge_first` (it holds the earlier bits of a range that ends inside that byte, and the
    flags' own bits there are 0). Every byte is written, so the mask needs no zeroing beforehand."""
    i = 0
    if merge_first:
        bits[0] |= _packbits8(flags, 0)
        i = 1
    address, out = flags.ctypes.data, bits.ctypes.data
    while i + 4 <= n_bytes:
        _store32(out + i, _packbits32(address + 8 * i))
        i += 4
    for i in range(i, n_bytes):
        bits[i] = _packbits8(flags, i)


def unify_pass(plan: Plan, out: Mapping[str, torch.Tensor], masks: Sequence[torch.Tensor]) -> np.ndarray:
    """One fused pass of unify: writes τ into `out` (flat float32 per key) and the bits of each
    task's mask into `masks` (uint8, packbits layout; every byte is written, so they may come
    uninitialized); returns the rescaler sums per key, float64 [2, N, keys]: Σ|τ_t| and Σ|m_t ⊙ τ|."""
    n_tasks = plan.ptrs.shape[0]
    per_piece = np.zeros((plan.piece_key.size, 2, n_tasks), dtype=np.float64)
    with torch_threads():
        _unify_kernel(plan.ptrs, Plan.pointers([out[k] for k in plan.keys]), Plan.pointers(masks), per_piece,
                      plan.piece_key, plan.piece_start, plan.piece_stop, plan.piece_flat, plan.block)
    sums = np.zeros((len(plan.keys), 2, n_tasks), dtype=np.float64)
    np.add.at(sums, plan.piece_key, per_piece)
    return sums.transpose(1, 2, 0)


# -- the k-th largest |entry| without a sort --------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def _radix_select(ptrs, lens, first, last, k):
    """The k-th largest |x| of the population (its float bits, and how many entries exceed it, and
    how many equal it), by three histogram levels on the bits of |x| (monotone in |x| for floats):
    12 high bits over the whole population (4 interleaved histograms, so repeated bins do not
    serialize), then the one bin's entries are collected and resolved on 12 and 7 more bits."""
    hist = np.zeros((4, _BINS1), np.int64)
    for i in range(first, last):
        bits = numba.carray(_void_ptr(ptrs[i]), (lens[i],), np.uint32)
        n = lens[i]
        stop = n - n % 4
        for j in range(0, stop, 4):
            hist[0, (bits[j] & _ABS) >> 19] += 1
            hist[1, (bits[j + 1] & _ABS) >> 19] += 1
            hist[2, (bits[j + 2] & _ABS) >> 19] += 1
            hist[3, (bits[j + 3] & _ABS) >> 19] += 1
        for j in range(stop, n):
            hist[0, (bits[j] & _ABS) >> 19] += 1
    level1 = hist.sum(axis=0)
    b1, above = _bin_from_top(level1, k)
    count = level1[b1]
    buf = np.empty(count + 1, np.uint32)  # + 1: the branch-free collection writes one slot past the last
    pos = 0
    for i in range(first, last):
        bits = numba.carray(_void_ptr(ptrs[i]), (lens[i],), np.uint32)
        for j in range(lens[i]):
            x = bits[j] & _ABS
            buf[pos] = x
            pos += (x >> 19) == b1  # branch-free: the slot is overwritten unless the entry is in bin b1
    level2 = np.zeros(_BINS1, np.int64)
    for j in range(count):
        level2[(buf[j] >> 7) & 0xFFF] += 1
    b2, above2 = _bin_from_top(level2, k - above)
    level3 = np.zeros(128, np.int64)
    for j in range(count):
        if (buf[j] >> 7) & 0xFFF == b2:
            level3[buf[j] & 0x7F] += 1
    b3, above3 = _bin_from_top(level3, k - above - above2)
    value = (np.uint32(b1) << 19) | (np.uint32(b2) << 7) | np.uint32(b3)
    return value, above + above2 + above3, level3[b3]


@numba.njit(nogil=True, cache=True)
def _sample_runs(n):
    """How many runs of _SAMPLE_RUN entries the sample of an n-entry population takes, and their
    spacing (a multiple of _SAMPLE_RUN, so runs start aligned: the first at entry 0)."""
    runs = max(1, min(_SAMPLE, n >> _SAMPLE_STRIDE_BITS) // _SAMPLE_RUN)
    return runs, n // runs // _SAMPLE_RUN * _SAMPLE_RUN


@numba.njit(nogil=True, cache=True)
def _strided_sample(ptrs, lens, first, last, n):
    """|x| bits of the sample: runs of _SAMPLE_RUN consecutive entries at evenly spaced
    population-wide positions (`_sample_runs`)."""
    runs, stride = _sample_runs(n)
    out = np.empty(runs * _SAMPLE_RUN, np.uint32)
    i, base, s = first, 0, 0
    bits = numba.carray(_void_ptr(ptrs[i]), (lens[i],), np.uint32)
    for r in range(runs):
        g = r * stride
        for _ in range(_SAMPLE_RUN):
            while g >= base + lens[i]:
                base += lens[i]
                i += 1
                bits = numba.carray(_void_ptr(ptrs[i]), (lens[i],), np.uint32)
            out[s] = bits[g - base] & _ABS
            s += 1
            g += 1
    return out


@numba.njit(nogil=True, cache=True, inline="never", fastmath=_COUNT_FASTMATH)
def _flag_entries(chunk, lo, hi, inside):
    """How many entries of `chunk` (int32 |x| bits, at most 2^24 of them) lie above hi, and
    inside[j] = 1 where chunk[j] lies in [lo, hi]. Counted in float32 lanes (exact below 2^24):
    with fastmath's reassociation LLVM vectorizes the count 8 lanes wide, where an integer count
    is widened to int64 lanes (numba's typing) and runs at half the speed. A function of its own,
    indexed from 0, so nothing else in the loop body stops the vectorization."""
    above = np.float32(0.0)
    for j in range(chunk.size):
        x = chunk[j] & np.int32(0x7FFFFFFF)
        above += np.float32(1.0) if x > hi else np.float32(0.0)
        inside[j] = np.uint8((x >= lo) & (x <= hi))
    return int(above)


@numba.njit(nogil=True, cache=True)
def _bracket_pass(ptrs, lens, first, last, lo, hi, buf):
    """How many |x| lie above hi, and the |x| bits in [lo, hi] collected into buf (a count of
    buf.size means it overflowed). Per _CHUNK-entry chunk, while it is in L1: flag the entries,
    list the 8-entry groups holding a flagged one (branch-free), then copy those groups
    branch-free, advancing the write position by each entry's flag."""
    above, count, cap = 0, 0, buf.size - 8
    inside = np.zeros(_CHUNK, np.uint8)
    groups = inside.view(np.uint64)  # 8 flags per word: bit 8·j of a word is entry j's flag
    flagged = np.empty(_CHUNK // 8, np.int64)
    for i in range(first, last):
        bits = numba.carray(_void_ptr(ptrs[i]), (lens[i],), np.int32)  # |x| bits fit in int32
        n = lens[i]
        whole = n - n % 8
        for start in range(0, whole, _CHUNK):
            chunk = bits[start:min(start + _CHUNK, whole)]
            above += _flag_entries(chunk, lo, hi, inside)
            listed = 0
            for w in range(chunk.size // 8):
                flagged[listed] = w
                listed += groups[w] != 0
            for q in range(listed):
                if count > cap:
                    return above, buf.size
                w = flagged[q]
                word = groups[w]
                for j in range(8):
                    buf[count] = chunk[w * 8 + j] & np.int32(0x7FFFFFFF)
                    count += (word >> np.uint64(8 * j)) & np.uint64(1)
        for j in range(whole, n):
            x = bits[j] & np.int32(0x7FFFFFFF)
            above += x > hi
            if (x >= lo) & (x <= hi):
                if count > cap:
                    return above, buf.size
                buf[count] = x
                count += 1
    return above, count


@numba.njit(nogil=True, cache=True, inline="never", fastmath=_COUNT_FASTMATH)
def _count_above_edges(chunk, e0, e1, e2, e3, e4, e5, e6, e7, counts):
    """counts[i] += how many entries of `chunk` (int32 |x| bits, at most 2^24) lie above edge i, for
    _EDGES = 8 edges at once: one read, 8 compare-and-adds per entry in float32 lanes (exact below
    2^24, vectorized 8 wide as in `_flag_entries`; 8 accumulators and the entry fit the registers)."""
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = np.float32(0.0)
    for j in range(chunk.size):
        x = chunk[j] & np.int32(0x7FFFFFFF)
        c0 += np.float32(1.0) if x > e0 else np.float32(0.0)
        c1 += np.float32(1.0) if x > e1 else np.float32(0.0)
        c2 += np.float32(1.0) if x > e2 else np.float32(0.0)
        c3 += np.float32(1.0) if x > e3 else np.float32(0.0)
        c4 += np.float32(1.0) if x > e4 else np.float32(0.0)
        c5 += np.float32(1.0) if x > e5 else np.float32(0.0)
        c6 += np.float32(1.0) if x > e6 else np.float32(0.0)
        c7 += np.float32(1.0) if x > e7 else np.float32(0.0)
    counts[0] += int(c0)
    counts[1] += int(c1)
    counts[2] += int(c2)
    counts[3] += int(c3)
    counts[4] += int(c4)
    counts[5] += int(c5)
    counts[6] += int(c6)
    counts[7] += int(c7)


@numba.njit(inline="always")
def _population_size(lens, first, last):
    """Entries of the population made of tensors first..last-1."""
    n = 0
    for i in range(first, last):
        n += lens[i]
    return n


@numba.njit(nogil=True, cache=True)
def _counted_bracket(ptrs, lens, first, last, k, sample):
    """A narrow bracket [lo, hi] of |x| bits that holds the k-th largest, with exact counts: the
    sample's coarse histogram (1/16-octave bins, the float bits' top 12) gives a bracket of ±3.5
    standard deviations of the sample rank, rounded out to bins; _EDGES edges spaced evenly across
    it are counted over the population in one pass (`_count_above_edges`), and the two neighbouring
    edges around rank k bound the answer. Returns (lo, hi, entries in [lo, hi]), or a count of -1
    where the edges miss rank k (the caller falls back to the radix selection)."""
    size, q = sample.size, k / _population_size(lens, first, last)
    spread = 3.5 * np.sqrt(size * q * (1.0 - q)) + 8.0
    rank_hi, rank_lo = size * q - spread, size * q + spread
    hist = np.zeros(_BINS1, np.int64)
    top = 0
    for x in sample:
        b = np.int64(x >> np.uint32(19))
        hist[b] += 1
        top = max(top, b)
    above, b = 0, top
    while b > 0 and above + hist[b] < rank_hi:
        above += hist[b]
        b -= 1
    hi = (b + 1 if rank_hi > 0 else top + 1) << 19  # at most 2^31: edge 0 fits int32
    while b > 0 and above + hist[b] < rank_lo:
        above += hist[b]
        b -= 1
    lo = b << 19
    edges = np.empty(_EDGES, np.int32)  # descending: counts above them ascend
    for i in range(_EDGES):
        edges[i] = np.int32(hi - 1 - (hi - lo) * i // (_EDGES - 1))
    counts = np.zeros(_EDGES, np.int64)
    for i in range(first, last):
        bits = numba.carray(_void_ptr(ptrs[i]), (lens[i],), np.int32)
        for start in range(0, lens[i], _CHUNK):
            _count_above_edges(bits[start:min(start + _CHUNK, lens[i])], edges[0], edges[1], edges[2], edges[3],
                               edges[4], edges[5], edges[6], edges[7], counts)
    if counts[0] >= k or counts[_EDGES - 1] < k:
        return np.uint32(0), np.uint32(0), -1
    j = 0
    while counts[j + 1] < k:
        j += 1
    return np.uint32(edges[j + 1] + 1), np.uint32(edges[j]), counts[j + 1] - counts[j]


@numba.njit(nogil=True, cache=True)
def _kth_largest_of(values, lo, hi, ranks):
    """The ranks[r]-th largest of `values` (uint32, all in [lo, hi]; ranks ascending, from 1): one
    histogram of value − lo (up to 12 bits, about one bin per value: a small set does not pay for
    zeroing and scanning 4096 bins), then a sort of each bin that holds one of them."""
    bins = 64
    while bins < values.size and bins < _BINS1:
        bins *= 2
    shift = 0
    while ((hi - lo) >> shift) >= bins:
        shift += 1
    hist = np.zeros(bins, np.int64)
    for x in values:
        hist[(x - lo) >> shift] += 1
    out = np.empty(ranks.size, np.uint32)
    members, sorted_bin, above = np.empty(0, np.uint32), -1, 0
    for r in range(ranks.size):
        b, above = _bin_from_top(hist, ranks[r])
        if b != sorted_bin:
            members = np.empty(hist[b], np.uint32)
            m = 0
            for x in values:
                if (x - lo) >> shift == b:
                    members[m] = x
                    m += 1
            members.sort()
            sorted_bin = b
        out[r] = members[members.size - (ranks[r] - above)]
    return out


@numba.njit(nogil=True, cache=True)
def _sampled_select(ptrs, lens, first, last, k):
    """`_radix_select`'s answer in about one pass (two for populations under _COUNTED_BELOW: a
    count, then a collection from cache). A strided sample of up to _SAMPLE entries brackets the
    k-th largest |x|: a large population takes ±3.5 standard deviations of its sample rank,
    and `_bracket_pass` counts the entries above the bracket and collects those inside; a small
    one (whose sample is small, so that bracket would hold up to 10% of it) first narrows it by an
    exact count at 8 edges (`_counted_bracket`), then collects the 1-2% between two edges. The
    k-th largest is resolved among those collected. A bracket that misses or overflows (a sample
    that was not representative, heavy ties) falls back to `_radix_select`."""
    n = _population_size(lens, first, last)
    sample = _strided_sample(ptrs, lens, first, last, n)
    if n < _COUNTED_BELOW:
        lo, hi, inside = _counted_bracket(ptrs, lens, first, last, k, sample)
        if inside < 0:
            return _radix_select(ptrs, lens, first, last, k)
        buf = np.empty(inside + 16, np.int32)  # exact, + the slack of a group copy
    else:
        size = sample.size
        q = k / n
        spread = 3.5 * np.sqrt(size * q * (1.0 - q)) + 8.0
        rank_hi, rank_lo = int(size * q - spread), int(size * q + spread)  # sample ranks from the top
        everything = np.uint32(0x7FFFFFFF)
        ends = _kth_largest_of(sample, np.uint32(0), everything,
                               np.array([max(rank_hi, 1), min(rank_lo, size)], np.int64))
        hi = ends[0] if rank_hi > 0 else everything
        lo = ends[1] if rank_lo < size else np.uint32(0)
        buf = np.empty(int(3.0 * n * (rank_lo - rank_hi) / size) + 4096, np.int32)
    above, count = _bracket_pass(ptrs, lens, first, last, np.int32(lo), np.int32(hi), buf)
    if count >= buf.size or above >= k or above + count < k:
        return _radix_select(ptrs, lens, first, last, k)
    found = buf[:count].view(np.uint32)
    value = _kth_largest_of(found, lo, hi, np.array([k - above], np.int64))[0]
    greater, equal = above, 0
    for j in range(count):
        greater += found[j] > value
        equal += found[j] == value
    return value, greater, equal


@numba.njit(inline="always")
def _bin_from_top(hist, k):
    """The bin holding the k-th largest entry of a histogram, and the count in the bins above it."""
    above, b = 0, hist.size - 1
    while above + hist[b] < k:
        above += hist[b]
        b -= 1
    return b, above


@numba.njit(parallel=True, nogil=True, cache=True)
def _select_kernel(ptrs, lens, population, ks, values, greater, equal):
    for p in prange(population.size - 1):
        first, last = population[p], population[p + 1]
        if lens[first:last].sum() >= _SAMPLED_FROM:
            values[p], greater[p], equal[p] = _sampled_select(ptrs, lens, first, last, ks[p])
        else:
            values[p], greater[p], equal[p] = _radix_select(ptrs, lens, first, last, ks[p])


@numba.njit(parallel=True, nogil=True, cache=True)
def _tied_kernel(ptrs, lens, population, value_bits, offsets, positions):
    """For each population p: the population-wide indices of its first offsets[p+1] - offsets[p]
    entries with |x| equal to the threshold (bits value_bits[p]), in order. A population that needs
    none is not read, and a scan stops at its last needed entry."""
    for p in prange(population.size - 1):
        pos, stop, base = offsets[p], offsets[p + 1], 0
        i = population[p]
        while pos < stop and i < population[p + 1]:
            bits = numba.carray(_void_ptr(ptrs[i]), (lens[i],), np.uint32)
            for j in range(lens[i]):
                if (bits[j] & _ABS) == value_bits[p]:
                    positions[pos] = base + j
                    pos += 1
                    if pos == stop:
                        break
            base += lens[i]
            i += 1


def kth_largest_abs(populations: Sequence[Sequence[torch.Tensor]],
                    ks: Sequence[int]) -> list[tuple[float, bool, torch.Tensor | None]]:
    """For each population (1-D float32 tensors, concatenated) and its k (1 ≤ k ≤ n): the k-th largest
    |entry| v, whether more than k entries have |x| ≥ v and, when so, the population-wide indices
    of the entries equal to v that the top k keeps (the first in order); all populations at once,
    in parallel."""
    tensors = [t.contiguous() for pop in populations for t in pop]
    ptrs = Plan.pointers(tensors)
    lens = np.array([t.numel() for t in tensors], dtype=np.int64)
    population = np.cumsum([0] + [len(pop) for pop in populations]).astype(np.int64)
    ks = np.asarray(ks, dtype=np.int64)
    values = np.empty(len(populations), dtype=np.uint32)
    greater, equal = (np.empty(len(populations), dtype=np.int64) for _ in range(2))
    with torch_threads():
        _select_kernel(ptrs, lens, population, ks, values, greater, equal)
    tied = greater + equal > ks
    needed = np.where(tied, ks - greater, 0)
    offsets = np.concatenate([[0], np.cumsum(needed)]).astype(np.int64)
    positions = np.empty(offsets[-1], dtype=np.int64)
    if tied.any():
        with torch_threads():
            _tied_kernel(ptrs, lens, population, values, offsets, positions)
    kept = torch.from_numpy(positions)
    return [(float(v), bool(t), kept[offsets[p]:offsets[p + 1]] if t else None)
            for p, (v, t) in enumerate(zip(values.view(np.float32), tied))]
