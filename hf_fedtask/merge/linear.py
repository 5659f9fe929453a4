"""Weighted averaging of task vectors without a stack of N vectors: one pass over a list of them,
or a running sum over a stream."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge import fused_passes, kernels
from hf_fedtask.merge.streaming import Layout
from hf_fedtask.merge.ties import check_compatible


def weighted_average(vectors: Iterable[TaskVector], weights: Iterable[float], backend: str = "auto") -> TaskVector:
    """Σ w_i·τ_i / Σ w_i, accumulated in float64 (in input order) and returned in the inputs' dtype.

    A sequence (vectors already in memory, as a server holds its round's updates) is averaged in
    one pass that reads each vector once; any other iterable (say, a generator that reads files)
    is summed as it streams, so memory is O(d) however many vectors come. `backend`: "numba" (the
    fused `fused_passes`: no float64 copy of any input; float32 CPU only), "torch" (the reference) or
    "auto" (numba for float32 CPU inputs, torch for the others); all give the same result bit for bit.
    Vectors on an accelerator are averaged there (the torch path) and the mean stays there.
    Raises ValueError on no inputs, non-positive total weight, or keys or shapes that differ from the
    first vector's."""
    if isinstance(vectors, Sequence):
        weights = list(weights)
        if vectors:
            check_compatible(vectors, weights)
            layout = Layout(vectors)  # its dtype promotes every vector's: float32 only if all are
            if kernels.use_kernels(backend, layout):
                return _mean_in_one_pass(vectors, weights, layout)
    return _running_mean(vectors, weights, backend)


def _mean_in_one_pass(vectors: Sequence[TaskVector], weights: list[float], layout: Layout) -> TaskVector:
    total = _total(weights)
    out = layout.empty_flat()
    fused_passes.weighted_mean(kernels.Plan(layout, [layout.flat_views(tv) for tv in vectors]), weights, total, out)
    return TaskVector(layout.unflatten(out))


def _running_mean(vectors: Iterable[TaskVector], weights: Iterable[float], backend: str) -> TaskVector:
    layout: Layout | None = None
    acc: dict[str, torch.Tensor] = {}
    plan: kernels.Plan | None = None
    fused = False
    used: list[float] = []
    for tv, w in zip(vectors, weights, strict=True):
        if layout is None:
            layout = Layout([tv])
            fused = kernels.use_kernels(backend, layout)
            acc = {k: torch.zeros(n, dtype=torch.float64, device=layout.device) for k, n in layout.numels.items()}
            template = {k: torch.empty(shape, device="meta") for k, shape in layout.shapes.items()}  # holds no data
        check_compatible([template, tv], [1.0, 1.0])  # the fused path reads raw memory: a mismatch must not reach it
        flat = layout.flat_views(tv)
        if fused and kernels.use_kernels(backend, Layout([tv])):  # no float64 copy of the input
            plan = kernels.Plan(layout, [flat]) if plan is None else plan.rebind([flat])
            fused_passes.add_scaled(plan, float(w), acc)
        else:
            for k, t in flat.items():
                acc[k].add_(t.to(torch.float64), alpha=float(w))
        used.append(float(w))
    if layout is None:
        raise ValueError("weighted_average of no task vectors")
    total = _total(used)
    if fused:
        out = layout.empty_flat()
        fused_passes.divide(plan, acc, total, out)
        return TaskVector(layout.unflatten(out))
    return TaskVector(layout.unflatten({k: (v / total).to(layout.dtypes[k]) for k, v in acc.items()}))


def _total(weights: list[float]) -> float:
    total = 0.0
    for w in weights:
        total += float(w)
    if total <= 0:
        raise ValueError(f"total weight must be positive, got {total}")
    return total
