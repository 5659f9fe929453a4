"""The top-k magnitude threshold without a sort: the k-th largest |entry| of each population (a
task's tensor, or a whole task vector), for TIES' trimming (`merge.ties`).

A population of 2^16 entries or more is read about once: a sample of 8-entry runs brackets the k-th
largest |x|, and one pass counts the entries above the bracket (a vectorized compare-and-count) and
collects the 1-10% inside it from the 8-entry groups that hold any, while they are in L1; the exact
value is resolved among those. Under 2^20 entries (a LoRA tensor), where the sample is small and its
bracket wide, one counting pass at 8 edges inside the bracket first narrows it, and the collection (a
second read, from cache) keeps the 1-2% between two edges. Smaller populations, and a bracket that
misses, take the radix selection: one pass histograms the high 12 bits of |x| (monotone in |x| for
floats), a second collects the one bin holding the k-th largest, and two more histogram levels over
that bin give the exact value. Populations (one per task, or per task and tensor) run in parallel.
The thresholds between these paths were chosen with benchmarks/merge_bench.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import torch
from numba import prange

from hf_fedtask.merge.kernels import Plan, torch_threads, void_ptr

_BINS1 = 1 << 12  # first and second histogram levels: 12 bits of |x| each (then 7)
_ABS = np.uint32(0x7FFFFFFF)
_SAMPLE = 1 << 16  # entries of the strided sample that brackets the k-th largest, at most
_SAMPLE_STRIDE_BITS = 6  # and at most one entry in 2^6
_SAMPLE_RUN = 8  # taken as runs of 8 consecutive entries (32 bytes): runs share cache lines, where
# single entries at the same density would each cost a line of their own
_CHUNK = 1 << 12  # entries flagged, then collected, while in L1
_COUNT_FASTMATH = {"reassoc", "nsz", "arcp", "contract", "nnan", "ninf"}  # counts of 0/1 floats: exact in any order
_SAMPLED_FROM = 1 << 16  # populations at least this large take the sampled selection (the size from which it pays)
_COUNTED_BELOW = 1 << 20  # and those under this first narrow the bracket by counting at _EDGES edges (their
# sample is small and its bracket wide; from 2^20 entries the extra counting pass no longer pays)
_EDGES = 8


@numba.njit(nogil=True, cache=True)
def _radix_select(ptrs, lens, first, last, k):
    """The k-th largest |x| of the population (its float bits, and how many entries exceed it, and
    how many equal it), by three histogram levels on the bits of |x| (monotone in |x| for floats):
    12 high bits over the whole population (4 interleaved histograms, so repeated bins do not
    serialize), then the one bin's entries are collected and resolved on 12 and 7 more bits."""
    hist = np.zeros((4, _BINS1), np.int64)
    for i in range(first, last):
        bits = numba.carray(void_ptr(ptrs[i]), (lens[i],), np.uint32)
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
        bits = numba.carray(void_ptr(ptrs[i]), (lens[i],), np.uint32)
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
    bits = numba.carray(void_ptr(ptrs[i]), (lens[i],), np.uint32)
    for r in range(runs):
        g = r * stride
        for _ in range(_SAMPLE_RUN):
            while g >= base + lens[i]:
                base += lens[i]
                i += 1
                bits = numba.carray(void_ptr(ptrs[i]), (lens[i],), np.uint32)
            out[s] = bits[g - base] & _ABS
            s += 1
            g += 1
    return out


@numba.njit(nogil=True, cache=True, inline="never", fastmath=_COUNT_FASTMATH)
def _flag_entries(chunk, lo, hi, inside):
    """How many entries of `chunk` (int32 |x| bits, at most 2^24 of them) lie above hi, and
    inside[j] = 1 where chunk[j] lies in [lo, hi]. Counted in float32 lanes (exact below 2^24):
    with fastmath's reassociation LLVM vectorizes the count 8 lanes wide, where an integer count
    is widened to int64 lanes (numba's typing), half as many per vector. A function of its own,
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
        bits = numba.carray(void_ptr(ptrs[i]), (lens[i],), np.int32)  # |x| bits fit in int32
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
        bits = numba.carray(void_ptr(ptrs[i]), (lens[i],), np.int32)
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
            bits = numba.carray(void_ptr(ptrs[i]), (lens[i],), np.uint32)
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
