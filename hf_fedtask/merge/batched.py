"""The batched merges: TIES, unify and task arithmetic as a few torch ops over all N tasks at once.

On an accelerator a merge's cost is the number of kernel launches, not the bytes: the streaming torch
path (`streaming`) gathers each chunk with one small copy per task and key, and runs a dozen ops per
chunk. Here the N task vectors are concatenated into one [N, C] tensor per chunk of their flat space
(one `torch.cat` over all tasks and keys of the chunk), and each step of a merge is one op over it:

  TIES    the top-k threshold of every (task, population) from one `torch.topk` per group of
          populations of one size (a population: one key, or the whole vector for scope="model"),
          then per chunk the trim (|x| compared with the tasks' thresholds: one op per key in the
          chunk), the sign election, the agreement mask and count, the weighted disjoint mean;
  unify   per chunk the elected sign, x·σ, its column maximum, the bit-packed masks of all tasks at
          once and the rescalers' row sums;
  task arithmetic  no stack at all: one multi-tensor add (`torch._foreach_add_`) per task over all keys.

The results are those of the streaming torch path and the numba kernels: the same float operations in
the same order. The sums that the stacked definitions take "in task order" (TIES' vote and weighted
sum, unify's Σ_t τ_t) stay a loop over the N rows of the stack, so they round as those paths do; the
sums whose order cannot matter (sign counts, agreement counts) are one reduction. Entries tied at a
task's threshold are kept in flat order until k are kept, as `ties.magnitude_prune` keeps them: the
cut is stored as the position of the last tied entry kept. Only unify's rescalers are summed in another
order (float32 row sums per chunk instead of per key and chunk), which moves them by float32 rounding.

Memory: the stack of a chunk and its scratch are `*_BYTES(itemsize)` bytes per stacked entry. A chunk
holds as many entries as `budget_bytes` allows (all of d when it fits, so the merge runs in one chunk);
the threshold selection batches populations the same way (at least one population at a time). The
budget is half of the memory free on the device (CUDA: free memory plus what torch's allocator holds
unused), on the CPU half of the available memory up to 2 GiB, on another accelerator 4 GiB;
`BUDGET_BYTES` overrides it.

Hand-written because neither torch nor peft merges dicts of tensors batched over tasks (peft's
`merge_utils` merges one parameter at a time and sorts each task's top k).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from hf_fedtask.merge.bitmask import pack_rows, packed_size
from hf_fedtask.merge.streaming import Layout, Piece

MEMORY_FRACTION = 0.5  # of the device's free memory, for one chunk's stack and scratch
CPU_MAX_BYTES = 2 << 30
OTHER_DEVICE_BYTES = 4 << 30
BUDGET_BYTES: int | None = None  # a fixed budget instead (tests set a small one to force many chunks)


def TIES_BYTES(itemsize: int) -> int:  # noqa: N802 - a constant per itemsize
    """Working bytes per stacked entry of TIES' merge pass: the stack, |x|, x·σ, the column thresholds
    (and tie cuts, 8 bytes), boolean masks."""
    return 4 * itemsize + 12


def SELECT_BYTES(itemsize: int) -> int:  # noqa: N802
    """Per population entry of the threshold selection: |x|, topk's values and int64 indices (at most
    every entry), a comparison, and for a tied population its cumulative count (int32)."""
    return 2 * itemsize + 16


def UNIFY_BYTES(itemsize: int) -> int:  # noqa: N802
    """Per stacked entry of unify: the stack, x·σ, the bool masks and their packing scratch (and a
    float32 copy where a 16-bit row sum is widened)."""
    return 2 * itemsize + 8


def budget_bytes(device: torch.device) -> int:
    """Bytes a batched merge may use for one chunk's stack and scratch (see the module docstring)."""
    if BUDGET_BYTES is not None:
        return BUDGET_BYTES
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(MEMORY_FRACTION * (free + cached))
    if device.type == "cpu":
        return int(min(CPU_MAX_BYTES, MEMORY_FRACTION * _available_cpu_bytes()))
    return OTHER_DEVICE_BYTES


def _available_cpu_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 2 * CPU_MAX_BYTES


class Stack:
    """N compatible task vectors as [N, C] chunks of their flat space (`TaskVector.flatten` order), in
    the layout's dtype on its device, each made by one `torch.cat`; C as the budget allows."""

    def __init__(self, layout: Layout, vectors: Sequence[Mapping[str, torch.Tensor]], bytes_per_entry: int):
        self.layout, self.n = layout, len(vectors)
        self.flats = [layout.flat_views(tv) for tv in vectors]
        self.budget = budget_bytes(layout.device)
        fits = self.budget // (max(self.n, 1) * bytes_per_entry)
        whole = fits >= layout.numel  # one chunk; else the most that fit, starting at whole mask bytes
        self.size = max(8, (layout.numel + 7 if whole else fits) // 8 * 8)
        self.offsets, start = {}, 0
        for key, numel in layout.numels.items():
            self.offsets[key] = start
            start += numel

    def cat(self, parts: list[torch.Tensor], rows: int) -> torch.Tensor:
        """The parts concatenated as `rows` rows, in the compute dtype (a fresh tensor)."""
        out = torch.cat(parts) if parts else torch.empty(0, dtype=self.layout.dtype, device=self.layout.device)
        return out.to(self.layout.dtype).view(rows, -1)

    def chunks(self) -> Iterator[tuple[int, list[Piece], torch.Tensor]]:
        """(flat start, pieces, the [N, C] stack of the chunk): a fresh tensor each, free to overwrite."""
        for start, pieces in self.layout.chunks(self.size):
            parts = [flat[p.key][p.start : p.stop] for flat in self.flats for p in pieces]
            yield start, pieces, self.cat(parts, self.n)


def scatter(chunk: torch.Tensor, pieces: Sequence[Piece], out: Mapping[str, torch.Tensor]) -> None:
    """Write a merged chunk into the flat per-key outputs: one multi-tensor copy."""
    torch._foreach_copy_([out[p.key][p.start : p.stop] for p in pieces],
                         list(chunk.split([p.stop - p.start for p in pieces])))


# -- TIES ---------------------------------------------------------------------------------------------


class Thresholds:
    """Which entries each task keeps: those with |x| > thr[t, j], plus those with |x| == thr[t, j] at a
    flat position <= cut[t, j] (a population whose threshold value is tied; -1 elsewhere). Column j is
    a key (scope "tensor") or the only column (scope "model"). `tied[j]`: whether any task's population
    in column j is tied (a chunk without one skips the tie test)."""

    def __init__(self, stack: Stack, density: float, scope: str):
        layout, n = stack.layout, stack.n
        self.per_key = scope == "tensor"
        self.index = {k: j for j, k in enumerate(layout.numels)} if self.per_key else dict.fromkeys(layout.numels, 0)
        width = len(layout.numels) if self.per_key else 1
        thr = torch.full((n, width), torch.inf, dtype=layout.dtype)  # k == 0: nothing kept
        cut = torch.full((n, width), -1, dtype=torch.int64)
        if self.per_key:  # populations of one size (same k) share a topk call
            groups: dict[int, list[str]] = {}
            for key, numel in layout.numels.items():
                groups.setdefault(numel, []).append(key)
            populations = [(keys, numel, int(density * numel)) for numel, keys in groups.items()]
        else:
            populations = [(list(layout.numels), layout.numel, int(density * layout.numel))]
        for keys, numel, k in populations:
            if k == 0:
                continue
            units = [(key, t) for key in keys for t in range(n)]  # rows: (its key, its task)
            rows = max(1, stack.budget // (numel * SELECT_BYTES(layout.dtype.itemsize)))
            for first in range(0, len(units), rows):
                batch = units[first : first + rows]
                if self.per_key:
                    parts = [stack.flats[t][key] for key, t in batch]
                else:
                    parts = [stack.flats[t][key] for _, t in batch for key in keys]
                value, kept_cut = _kth_largest(stack.cat(parts, len(batch)).abs_(), k)
                task = torch.tensor([t for _, t in batch])
                column = torch.tensor([self.index[key] for key, _ in batch])
                offset = torch.tensor([stack.offsets[key] if self.per_key else 0 for key, _ in batch])
                thr[task, column] = value
                cut[task, column] = torch.where(kept_cut >= 0, kept_cut + offset, -1)
        self.tied = (cut >= 0).any(0).tolist()
        self.thr, self.cut = thr.to(layout.device), cut.to(layout.device)


def _kth_largest(magnitude: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of |x| ([R, n], 1 ≤ k < n, as density < 1 makes it): the threshold that keeps its top k
    (the float below the k-th largest v where exactly k entries reach v; v where more do; 0 where v is 0,
    keeping every non-zero entry), and where more than k reach v, the position of the last entry equal
    to v that the top k keeps (else -1); as CPU tensors. One topk of k + 1 for all rows: more than k
    entries reach v exactly where the (k+1)-th largest equals v, and the entries above v are among those
    k + 1, so only a tied row is read again (a cumulative count of its entries equal to v)."""
    top = torch.topk(magnitude, k + 1, dim=1, sorted=False).values
    below, v = torch.topk(top, 2, dim=1, largest=False).values.unbind(1)  # the (k+1)-th and k-th largest
    tied = (below == v) & (v > 0)
    cut = torch.full(v.shape, -1, dtype=torch.int64, device=v.device)
    rows = tied.nonzero().squeeze(1)
    if len(rows):
        m, vt = (magnitude, v[:, None]) if len(rows) == len(v) else (magnitude[rows], v[rows, None])
        need = k - (top[rows] > vt).sum(1, dtype=torch.int32)  # the tied entries kept: the first `need`
        count = torch.cumsum(m == vt, 1, dtype=torch.int32)
        cut[rows] = torch.searchsorted(count, need[:, None]).squeeze(1)
    v, tied, cut = v.cpu(), tied.cpu(), cut.cpu()
    below_v = torch.nextafter(v, torch.zeros_like(v))  # |x| > it keeps exactly the entries reaching v
    return torch.where(~tied & (v > 0), below_v, v), cut


@torch.no_grad()
def ties(layout: Layout, vectors: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], density: float,
         method: str, scope: str) -> dict[str, torch.Tensor]:
    """TIES (see `ties.ties`) batched over the tasks: the flat merged tensor per key."""
    stack = Stack(layout, vectors, TIES_BYTES(layout.dtype.itemsize))
    cuts = Thresholds(stack, density, scope) if density < 1 else None
    opmath = torch.float32 if layout.dtype in (torch.float16, torch.bfloat16) else layout.dtype
    w = torch.tensor([float(x) for x in weights], dtype=opmath, device=layout.device)[:, None]
    out = layout.empty_flat()
    for start, pieces, x in stack.chunks():
        if cuts is not None:
            _trim(x, start, pieces, cuts)
        scatter(_elect_and_merge(x, w, method), pieces, out)
    return out


def _trim(x: torch.Tensor, start: int, pieces: Sequence[Piece], cuts: Thresholds) -> None:
    """Zero, in place, the entries of the [N, C] chunk its task's population does not keep: one
    comparison with a column of thresholds per key in the chunk (one for the chunk with scope="model")."""
    magnitude = x.abs()
    drop = torch.empty_like(x, dtype=torch.bool)
    spans = [(p.chunk_slice, cuts.index[p.key]) for p in pieces]
    if len({j for _, j in spans}) == 1:
        spans = [(slice(0, x.shape[1]), spans[0][1])]
    for span, j in spans:
        part, thr = magnitude[:, span], cuts.thr[:, j : j + 1]
        torch.le(part, thr, out=drop[:, span])
        if cuts.tied[j]:  # and those equal to it up to the last kept tie
            position = torch.arange(start + span.start, start + span.stop, device=x.device)
            kept_tie = (part == thr).logical_and_(position <= cuts.cut[:, j : j + 1])
            drop[:, span].logical_and_(kept_tie.logical_not_())
    del magnitude
    x.masked_fill_(drop, 0)  # +0, as torch.hardshrink writes


def _elect_and_merge(x: torch.Tensor, w: torch.Tensor, method: str) -> torch.Tensor:
    """TIES' election and disjoint mean of a trimmed [N, C] chunk (overwritten), as `ties._merge_chunk`
    computes them: the vote and the weighted sum over the tasks in order, the counts in one sum."""
    if method == "total":
        vote = x[0].clone()
        for row in x[1:]:
            vote += row
    else:
        vote = x.sign().sum(0)  # small integers: exact in any order
    majority = torch.ge(vote, 0, out=vote).mul_(2).sub_(1)  # +1, or -1 where the vote is negative
    agree = torch.mul(x, majority).gt_(0)  # 1 where the entry agrees (zeros never do), else 0
    count = agree.sum(0)
    x.mul_(agree)
    del agree
    x.mul_(w)  # (τ·agree)·w_t per row, w_t rounded as a scalar multiply rounds it (opmath for 16-bit floats)
    total = x[0]
    for row in x[1:]:
        total += row
    return total.div_(count.clamp_(min=1))


# -- unify --------------------------------------------------------------------------------------------


@torch.no_grad()
def unify(layout: Layout, vectors: Sequence[Mapping[str, torch.Tensor]], per_key_sums: bool
          ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """unify (see `unify.unify`) batched over the tasks: the flat unified tensor per key, each task's
    bit-packed mask, and the rescalers' sums [2, N, keys] (Σ|τ_t| and Σ|m_t ⊙ τ|; one column of totals
    unless `per_key_sums`)."""
    stack = Stack(layout, vectors, UNIFY_BYTES(layout.dtype.itemsize))
    n, device = stack.n, layout.device
    keys = {k: j for j, k in enumerate(layout.numels)}
    unified = layout.empty_flat()
    packed = torch.zeros(n, packed_size(layout.numel), dtype=torch.uint8, device=device)
    sums = torch.zeros(2, n, len(keys) if per_key_sums else 1, dtype=torch.float64, device=device)
    sum_dtype = torch.promote_types(layout.dtype, torch.float32)
    for start, pieces, x in stack.chunks():
        sign = x[0].clone()
        for row in x[1:]:
            sign += row  # in task order, as Σ_t τ_t is defined
        sign.sign_()
        q = torch.mul(x, sign)  # x_t·σ: > 0 exactly where τ_t agrees with the elected sign
        magnitude = q.amax(0).clamp_(min=0)
        scatter(sign.mul_(magnitude), pieces, unified)
        row_bytes = pack_rows(q > 0)
        packed[:, start // 8 : start // 8 + row_bytes.shape[1]] = row_bytes
        del row_bytes
        x.abs_()
        q.gt_(0).mul_(magnitude)  # |m_t ⊙ τ|
        if per_key_sums:
            for p in pieces:
                sums[0, :, keys[p.key]] += x[:, p.chunk_slice].sum(1, dtype=sum_dtype).double()
                sums[1, :, keys[p.key]] += q[:, p.chunk_slice].sum(1, dtype=sum_dtype).double()
        else:
            sums[0, :, 0] += x.sum(1, dtype=sum_dtype).double()
            sums[1, :, 0] += q.sum(1, dtype=sum_dtype).double()
    return unified, [row.clone() for row in packed], sums  # a tensor each, as the other paths return them


# -- task arithmetic ----------------------------------------------------------------------------------


@torch.no_grad()
def task_arithmetic(vectors: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """Σ_t w_t·τ_t per key, each task added to all keys' sums in one multi-tensor op (a weighted sum
    needs no stack): the same `add_(τ, alpha=w)` per key and task, in task order, as `ties.task_arithmetic`."""
    keys = list(vectors[0])
    acc = [torch.zeros_like(vectors[0][k]) for k in keys]
    for tv, w in zip(vectors, weights):
        torch._foreach_add_(acc, [tv[k] for k in keys], alpha=float(w))
    return dict(zip(keys, acc))
