"""Task arithmetic, magnitude pruning and TIES merging over TaskVectors, per tensor as
`peft.utils.merge_utils` defines them (and equal to it on the same inputs, see tests).

Written here rather than called from peft because peft's functions stack the N tensors of every
parameter and copy the stack several times. `ties` streams instead (see `streaming`): it finds each
task's magnitude threshold one task at a time (one |τ_t| copy of a parameter, or of the whole vector
for scope="model"), then trims on the fly, elects signs and takes the disjoint mean chunk by chunk,
with the same floating-point operations in the same order as the stacked definition, so results are
bit for bit those of trimming every vector first. Memory is O(d) plus O(N·chunk) scratch.

Vectors whose tensors sit on an accelerator are merged there by the batched torch ops of `batched`
(one stack of all tasks per chunk, a few ops over it: the numba kernels and numpy's selection are
CPU-only) and the results stay there; CPU vectors take the paths they always took."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge import batched, fused_passes, kernels, threshold_select
from hf_fedtask.merge.streaming import Layout, Piece, chunk_len, gather, scatter

SIGN_METHODS = ("total", "frequency")
SCOPES = ("tensor", "model")


def check_compatible(vectors: Sequence[TaskVector], weights: Sequence[float]) -> None:
    """Raise ValueError unless there is one weight per vector and all vectors share keys and shapes."""
    if not vectors:
        raise ValueError("no task vectors to merge")
    if len(weights) != len(vectors):
        raise ValueError(f"{len(weights)} weights for {len(vectors)} task vectors")
    first = vectors[0]
    shapes = {key: tensor.shape for key, tensor in first.items()}
    for tv in vectors[1:]:
        if tv.keys() != first.keys():
            raise ValueError(f"task vectors disagree on key {min(set(tv) ^ set(first))!r}")
        for key, tensor in tv.items():
            if tensor.shape != shapes[key]:
                raise ValueError(f"task vectors disagree on the shape of {key!r}: "
                                 f"{tuple(tensor.shape)} and {tuple(shapes[key])}")


def task_arithmetic(vectors: Sequence[TaskVector], weights: Sequence[float], backend: str = "auto") -> TaskVector:
    """Σ_t w_t·τ_t, summed in task order per key. `backend`: "torch" (one add per task and key),
    "batched" (one multi-tensor add per task over all keys: `batched.task_arithmetic`) or "auto"
    (batched on an accelerator, torch on the CPU); the same result bit for bit."""
    check_compatible(vectors, weights)
    if backend not in ("auto", "torch", "batched"):
        raise ValueError(f"backend must be one of ('auto', 'torch', 'batched'), got {backend!r}")
    if backend == "batched" or (backend == "auto" and Layout(vectors).device.type != "cpu"):
        return TaskVector(batched.task_arithmetic(vectors, weights))
    out = {}
    for key in vectors[0]:
        acc = torch.zeros_like(vectors[0][key])
        for tv, w in zip(vectors, weights):
            acc.add_(tv[key], alpha=float(w))
        out[key] = acc
    return TaskVector(out)


def magnitude_prune(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the top int(density·n) entries of |tensor|, zero the rest (density ≥ 1 keeps all).
    Entries tied at the threshold are kept in index order until k are kept (peft's torch.topk
    leaves that choice unspecified; here it is reproducible, and the same in `ties`' kernels)."""
    if density < 0:
        raise ValueError(f"density must be >= 0, got {density}")
    if density >= 1:
        return tensor
    k = int(density * tensor.numel())
    flat = tensor.reshape(-1)
    if k == 0:
        return torch.zeros_like(tensor)
    magnitude = flat.abs()
    v = torch.topk(magnitude, k).values.min()
    keep = magnitude > v
    tied = (magnitude == v).nonzero().squeeze(1)
    keep[tied[: k - int(keep.sum())]] = True
    return (flat * keep).reshape(tensor.shape)


@torch.no_grad()
def ties(
    vectors: Sequence[TaskVector],
    weights: Sequence[float],
    density: float,
    majority_sign_method: str = "total",
    scope: str = "tensor",
    backend: str = "auto",
) -> TaskVector:
    """TIES: trim each τ_t to `density`, elect the sign per entry from the *unweighted* trimmed
    values (sum for "total", sign count for "frequency"; a tie goes to +), then average the weighted
    agreeing entries over their count (weights act as multipliers, as in peft).

    `scope="tensor"` trims each parameter on its own (peft's `ties`); `scope="model"` keeps the top
    `density` of each task vector as a whole (the TIES paper). Entries tied at a task's threshold
    value are kept in flat order until k are kept, as in `magnitude_prune`. Merges where the tensors
    are. `backend`: "numba" (the fused kernels of `fused_passes`; float32 CPU only), "batched" (a few
    torch ops over a stack of all tasks, `batched`: the one taken on an accelerator), "torch" (the
    reference streaming path) or "auto" (numba where it applies, batched on an accelerator, else
    torch). All give the same result bit for bit."""
    check_compatible(vectors, weights)
    _check_method(majority_sign_method)
    if scope not in SCOPES:
        raise ValueError(f"scope must be 'tensor' or 'model', got {scope!r}")
    if density < 0:
        raise ValueError(f"density must be >= 0, got {density}")
    layout = Layout(vectors)
    path = kernels.choose(backend, layout)
    if path == "batched":
        return TaskVector(layout.unflatten(batched.ties(layout, vectors, weights, density, majority_sign_method,
                                                         scope)))
    flats = [layout.flat_views(tv) for tv in vectors]
    if path == "numba":
        cuts = [_cuts(flat, density, scope, selected) for flat, selected in
                zip(flats, _select_all(flats, density, scope))]
        lambd = np.array([[-math.inf if cut[k].lambd is None else cut[k].lambd for k in layout.numels]
                          for cut in cuts])
        out = layout.empty_flat()
        fused_passes.ties_merge(kernels.Plan(layout, flats), lambd, weights, majority_sign_method == "frequency",
                                out)
        _merge_tied_entries(flats, cuts, weights, majority_sign_method, out)
        return TaskVector(layout.unflatten(out))
    elif layout.device.type != "cpu":  # an accelerator: the selection in torch there, one task at a time
        cuts = [_cuts(flat, density, scope) for flat in flats]
    else:
        # threshold selection is numpy work (copy, introselect) that releases the GIL: a task per core
        with ThreadPoolExecutor(max_workers=min(torch.get_num_threads(), len(flats))) as pool:
            cuts = list(pool.map(lambda flat: _cuts(flat, density, scope), flats))

    def fill(rows: torch.Tensor, pieces: Sequence[Piece]) -> None:
        for row, flat, cut in zip(rows, flats, cuts):
            for p in pieces:
                cut[p.key].apply(flat[p.key][p.start : p.stop], p, row[p.chunk_slice])

    return TaskVector(layout.unflatten(_elect_and_merge(layout, fill, weights, majority_sign_method)))


def _merge_tied_entries(flats: list[dict[str, torch.Tensor]], cuts: list[dict[str, _Cut]], weights: Sequence[float],
                        method: str, out: dict[str, torch.Tensor]) -> None:
    """Redo, with the reference chunk merge, the few entries where some task keeps values tied at its
    threshold (the kernel trimmed at |x| > v, dropping every tied value): the entries are elementwise
    independent, so merging just those columns gives them exactly as the torch path does."""
    for key in out:
        tied = [cut[key].ties for cut in cuts if cut[key].ties is not None]
        if not tied:
            continue
        positions = torch.cat(tied).unique()
        rows = torch.stack([flat[key][positions] for flat in flats]).to(out[key].dtype)
        for row, cut in zip(rows, cuts):
            c = cut[key]
            if c.lambd is not None:
                keep = (torch.isin(positions, c.ties) if c.ties is not None
                        else torch.zeros_like(positions, dtype=torch.bool))
                row.copy_(torch.where(keep, row, torch.hardshrink(row, c.lambd)))
        out[key][positions] = _merge_chunk(rows, torch.empty_like(rows), weights, method)


def trim(tv: TaskVector, density: float, scope: str = "tensor") -> TaskVector:
    """Magnitude-trim a task vector per parameter ("tensor") or over all its entries ("model").
    A materialized copy; `ties` trims on the fly instead."""
    if scope == "tensor":
        return TaskVector({k: magnitude_prune(v, density) for k, v in tv.items()})
    if scope == "model":
        return TaskVector.unflatten(magnitude_prune(tv.flatten(), density), tv)
    raise ValueError(f"scope must be 'tensor' or 'model', got {scope!r}")


@torch.no_grad()
def elect_and_merge(trimmed: Sequence[torch.Tensor], weights: Sequence[float], method: str = "total") -> torch.Tensor:
    """The sign election and disjoint mean of TIES on one parameter's already-trimmed task tensors."""
    _check_method(method)
    vectors = [{"": t} for t in trimmed]
    layout = Layout(vectors)
    flats = [layout.flat_views(v) for v in vectors]
    merged = _elect_and_merge(layout, lambda rows, pieces: gather(flats, pieces, rows), weights, method)
    return layout.unflatten(merged)[""]


@torch.no_grad()
def sign_similarity(vectors: Sequence[TaskVector]) -> torch.Tensor:
    """MaTU Eq. 5: S[t, t'] = ½·(mean_j sgn(τ_t[j])·sgn(τ_t'[j]) + 1), a T×T matrix in [0, 1].
    The Gram matrix of signs is summed chunk by chunk (exact integer counts), never stacked; on the
    vectors' device, where the matrix is returned."""
    check_compatible(vectors, [1.0] * len(vectors))
    layout = Layout(vectors)
    flats = [layout.flat_views(tv) for tv in vectors]
    signs = torch.empty(len(vectors), chunk_len(len(vectors), 4, layout.numel, layout.device), device=layout.device)
    gram = torch.zeros(len(vectors), len(vectors), dtype=torch.float64, device=layout.device)
    for _, pieces in layout.chunks(signs.shape[1]):
        s = gather(flats, pieces, signs[:, : pieces[-1].chunk_slice.stop]).sign_()
        gram += (s @ s.T).double()
    return 0.5 * (gram.to(layout.dtype) / layout.numel + 1.0)


def agreement_mask(vectors: Sequence[TaskVector], rho: float = 0.4, backend: str = "auto") -> TaskVector:
    """MaTU Eq. 3 (from Gradient Masked Averaging): α[j] = |mean_n sgn(τ_n[j])|; the soft mask is 1
    where α ≥ ρ and α elsewhere, so disagreeing entries are scaled down, not dropped. `backend`:
    "numba" (`fused_passes.agreement`: one read of each vector, no per-task sign tensors; float32),
    "torch" (the reference) or "auto"; both give the same mask bit for bit."""
    check_compatible(vectors, [1.0] * len(vectors))
    layout = Layout(vectors)
    if kernels.use_kernels(backend, layout):
        flats = [layout.flat_views(tv) for tv in vectors]
        out = layout.empty_flat()
        fused_passes.agreement(kernels.Plan(layout, flats), rho, out)
        return TaskVector(layout.unflatten(out))
    out = {}
    for key in vectors[0]:
        alpha = sum(tv[key].sign() for tv in vectors).abs() / len(vectors)
        out[key] = torch.where(alpha >= rho, torch.ones_like(alpha), alpha)
    return TaskVector(out)


# -- streaming election and disjoint mean ------------------------------------------------------------


def _check_method(method: str) -> None:
    if method not in SIGN_METHODS:
        raise ValueError(f"majority_sign_method must be one of {SIGN_METHODS}, got {method!r}")


def _elect_and_merge(
    layout: Layout,
    fill: Callable[[torch.Tensor, Sequence[Piece]], None],
    weights: Sequence[float],
    method: str,
) -> dict[str, torch.Tensor]:
    """Run TIES' election and disjoint mean chunk by chunk; `fill(rows, pieces)` writes each task's
    trimmed chunk into its row. Returns the flat merged tensor per key."""
    out = layout.empty_flat()
    size = chunk_len(len(weights), layout.dtype.itemsize, layout.numel, layout.device)
    trimmed = torch.empty(len(weights), size, dtype=layout.dtype, device=layout.device)
    scratch = torch.empty_like(trimmed)
    for _, pieces in layout.chunks(size):
        n = pieces[-1].chunk_slice.stop
        fill(trimmed[:, :n], pieces)
        scatter(_merge_chunk(trimmed[:, :n], scratch[:, :n], weights, method), pieces, out)
    return out


def _merge_chunk(trimmed: torch.Tensor, scratch: torch.Tensor, weights: Sequence[float], method: str) -> torch.Tensor:
    """Election and disjoint mean of one chunk (rows = tasks). The sums run over the tasks in order,
    as the stacked definition does; `trimmed` and `scratch` are overwritten."""
    if method == "total":
        vote = trimmed[0].clone()
        for row in trimmed[1:]:
            vote += row
    else:
        vote = torch.sign(trimmed, out=scratch).sum(0)  # small integers: exact in any order
    majority = torch.ge(vote, 0, out=vote).mul_(2).sub_(1)  # +1, or -1 where the vote is negative
    agree = torch.gt(torch.mul(trimmed, majority, out=scratch), 0, out=scratch)  # zeros never agree
    count = agree.sum(0)
    trimmed.mul_(agree)
    total = trimmed[0].mul_(float(weights[0]))  # (τ·agree)·w is (τ·w)·agree exactly: agree is 0 or 1
    for row, w in zip(trimmed[1:], weights[1:]):
        total += row.mul_(float(w))
    return total.div_(count.clamp_(min=1))


# -- magnitude thresholds ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Cut:
    """Which entries of one task's tensor survive trimming: those with |x| > lambd (all when lambd is
    None), plus `ties`: sorted key-local indices of entries equal to lambd that top-k keeps."""

    lambd: float | None = None
    ties: torch.Tensor | None = None

    def apply(self, src: torch.Tensor, piece: Piece, out: torch.Tensor) -> None:
        """Write the trimmed `src` (the piece's entries) into `out`."""
        if src.dtype != out.dtype:
            src = src.to(out.dtype)
        if self.lambd is None:
            out.copy_(src)
            return
        torch.hardshrink(src, self.lambd, out=out)  # x where |x| > lambd, else 0: trimming in one op
        if self.ties is not None:
            bounds = torch.tensor([piece.start, piece.stop], device=self.ties.device)
            lo, hi = torch.searchsorted(self.ties, bounds).tolist()
            idx = self.ties[lo:hi] - piece.start
            out[idx] = src[idx]


def _populations(flat: dict[str, torch.Tensor], density: float, scope: str) -> list[tuple[list[str], int]]:
    """The groups of keys trimmed together (each key alone, or all of them) and how many entries each keeps."""
    if scope == "tensor":
        return [([k], int(density * t.numel())) for k, t in flat.items()]
    return [(list(flat), int(density * sum(t.numel() for t in flat.values())))]


def _select_all(flats: list[dict[str, torch.Tensor]], density: float, scope: str) -> list[list | None]:
    """Per task, each population's (k-th largest |x|, tied) from one parallel kernel call (None for
    a population that keeps nothing; None for a task when nothing is trimmed)."""
    if density >= 1:
        return [None] * len(flats)
    groups = [_populations(flat, density, scope) for flat in flats]
    todo = [(t, i) for t, pops in enumerate(groups) for i, (_, k) in enumerate(pops) if k > 0]
    found = threshold_select.kth_largest_abs([[flats[t][key] for key in groups[t][i][0]] for t, i in todo],
                                    [groups[t][i][1] for t, i in todo])
    selected = [[None] * len(pops) for pops in groups]
    for (t, i), result in zip(todo, found):
        selected[t][i] = result
    return selected


def _cuts(flat: dict[str, torch.Tensor], density: float, scope: str, selected: list | None = None) -> dict[str, _Cut]:
    """Per key, the trimming of one task vector (given as 1-D tensors) at `density`. `selected`: each
    population's (k-th largest |x|, tied) when already known (the fused selection)."""
    if density >= 1:
        return {k: _Cut() for k in flat}
    out = {}
    for i, (keys, k) in enumerate(_populations(flat, density, scope)):
        tensors = [flat[key] for key in keys]
        found = selected[i] if selected is not None else (_kth_largest_abs(tensors, k) if k else None)
        out.update(zip(keys, _cut(tensors, k, found)))
    return out


def _cut(tensors: list[torch.Tensor], k: int, found: tuple | None) -> list[_Cut]:
    """Cuts keeping the k largest |entries| of the concatenated tensors, the ones `magnitude_prune`
    keeps (entries tied at the threshold value in order). `found`: the k-th largest |entry|, whether
    more than k entries reach it, and (from the kernels) which of the tied entries are kept."""
    if k == 0:
        return [_Cut(math.inf)] * len(tensors)
    v, tied = found[:2]
    if v == 0:  # fewer than k non-zero entries: keep all of them (kept zeros would never vote)
        return [_Cut(0.0)] * len(tensors)
    if not tied:  # exactly k entries have |x| >= v: keep those, i.e. |x| > the next float below v
        return [_Cut(_below(v, t.dtype)) for t in tensors]
    # more than k entries have |x| >= v, so only the first of those equal to v are kept
    if len(found) > 2:
        tied_kept = found[2]
    else:
        flat = torch.cat(tensors).abs()
        tied_kept = (flat == v).nonzero().squeeze(1)[: k - int((flat > v).sum())]
    cuts, offset = [], 0
    for t in tensors:
        mine = tied_kept[(tied_kept >= offset) & (tied_kept < offset + t.numel())] - offset
        cuts.append(_Cut(v, mine))
        offset += t.numel()
    return cuts


_NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _below(v: float, dtype: torch.dtype) -> float:
    """The largest value of `dtype` below the positive `v` (a value of that dtype). numpy where it has
    the dtype: torch's scalar ops cost tens of µs each, and a LoRA adapter trims thousands of populations."""
    if dtype in _NUMPY_FLOATS:
        kind = _NUMPY_FLOATS[dtype]
        return float(np.nextafter(kind(v), kind(0)))
    return torch.nextafter(torch.tensor(v, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()


def _kth_largest_abs(tensors: list[torch.Tensor], k: int) -> tuple[float, bool]:
    """The k-th largest |entry| v of the concatenated 1-D tensors (1 ≤ k ≤ n), and whether more than
    k entries have |x| ≥ v. One |x| copy of the population, selected in place with numpy's
    introselect: torch.kthvalue and torch.topk are much slower on millions of entries
    on a CPU (on an accelerator, where numpy cannot reach, torch.kthvalue there)."""
    if tensors[0].device.type != "cpu":
        magnitude = torch.cat([t.abs() for t in tensors])
        v = torch.kthvalue(magnitude, magnitude.numel() - k + 1).values  # the k-th largest
        return float(v), bool((magnitude >= v).sum() > k)
    a = np.concatenate([np.abs(_numpy(t)) for t in tensors])
    lower = a.size - k
    a.partition(lower)  # a[lower] is the k-th largest; a[:lower] holds the entries <= it
    v = a[lower]
    return float(v), bool(np.count_nonzero(a[:lower] == v))


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16, which numpy lacks, as a float32 copy)."""
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
