"""Fused merge passes: TIES, unify, weighted means and MaTU's sign agreement, each in one compiled
pass over the flat space of N float32 task vectors (see `kernels` for why and when they run).

Each pass reads a cache-sized piece of every task (`SUB` entries) and does all of its work there:
TIES' trim, election and disjoint mean; unify's sign, largest agreeing magnitude, bit-packed masks and
rescaler sums; the float64 weighted sum; the agreement count. The TIES and unify passes sweep 2 or 4
tasks at once over each piece, so that one load and store of a running sum or maximum serves several
tasks; sums are still taken in task order.

Results are the torch path's bit for bit: `ties`' merged vector, `unify`'s vector and masks (except
that where unify's elected sign is 0 the torch path may write -0.0 and the kernel +0.0), weighted
means (float64 sums with torch's fused multiply-add) and the agreement mask. Only unify's rescaler
sums are accumulated in another order (vectorized float32 partial sums per SUB entries, added up in
float64, where the torch path sums float32 per cache-sized chunk), which moves a rescaler by at most a
few float32 ulps. One movemask is spelled in LLVM IR (`_packbits32`): numba has no spelling for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from hf_fedtask.merge.kernels import Plan, torch_threads, void_ptr

# Entries of one pass over all N tasks, kept in L2 between the passes: long runs per input stream,
# still cache-resident (the sizes compared: benchmarks/merge_bench.py).
SUB = 1 << 12


@numba.njit(inline="always")
def _row(ptrs, t, k, s, m):
    """Task t's entries s..s+m of tensor k, read in place."""
    return numba.carray(void_ptr(ptrs[t, k]), (s + m,), np.float32)[s:]


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
            out = numba.carray(void_ptr(out_ptrs[k]), (s1,), np.float32)
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


# Sweeps of 2 tasks at once: each load and store of the running vote, count and sum serves two tasks,
# half the traffic of one task per sweep. The first sweep assigns where the later ones add, so every
# sum is taken in task order from the first task's value, as the torch path takes it: results are
# unchanged bit for bit, the sign of a zero included.


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
            x = numba.carray(void_ptr(ptrs[0, k]), (s1,), np.float32)
            acc = numba.carray(void_ptr(acc_ptrs[k]), (s1,), np.float64)
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
            out = numba.carray(void_ptr(out_ptrs[k]), (s1,), np.float32)
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
            acc = numba.carray(void_ptr(acc_ptrs[k]), (s1,), np.float64)
            out = numba.carray(void_ptr(out_ptrs[k]), (s1,), np.float32)
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
        _divide_kernel(Plan.pointers([acc[k] for k in plan.keys]), float(total),
                       Plan.pointers([out[k] for k in plan.keys]),
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
            out = numba.carray(void_ptr(out_ptrs[k]), (s1,), np.float32)
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
            out = numba.carray(void_ptr(out_ptrs[k]), (s1,), np.float32)
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
                    bits = numba.carray(void_ptr(mask_ptrs[t]), ((flat0 - lead) // 8 + n_bytes,), np.uint8)
                    _pack_bits(bits[(flat0 - lead) // 8:], flags[t], n_bytes, lead > 0)


# The sweeps below take 2 or 4 tasks at once: each load and store of the running sum or maximum then
# serves several tasks (the sum is still taken in task order, and a max is exact in any order, so
# results are unchanged bit for bit).


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
