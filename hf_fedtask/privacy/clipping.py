"""Joint L2 clipping of one client's whole upload: every vector it sends, taken as one long vector, is
scaled by min(1, C/‖upload‖) (McMahan et al., 2018, "flat clipping"), so the concatenation of all the
sums a strategy aggregates moves by at most C when one client's upload is added, 2C when it is replaced."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from hf_fedtask.core.taskvector import TaskVector


def global_norm(vectors: Mapping[str, TaskVector], skip: Iterable[str] = ()) -> float:
    """The L2 norm of all floating-point tensors of `vectors` together (entries in `skip` left out), in float64."""
    skip = set(skip)
    total = 0.0
    for name, tv in vectors.items():
        if name in skip:
            continue
        for t in tv.values():
            if t.is_floating_point():
                total += float(torch.sum(t.double() ** 2))
    return math.sqrt(total)


def clip_jointly(vectors: Mapping[str, TaskVector], clip: float,
                 skip: Iterable[str] = ()) -> tuple[dict[str, TaskVector], float, bool]:
    """`vectors` scaled together to L2 norm at most `clip` (entries in `skip`, data-independent bookkeeping,
    untouched); returns (the clipped vectors, the norm before clipping, whether it was scaled)."""
    skip = set(skip)
    norm = global_norm(vectors, skip)
    if norm <= clip:
        return dict(vectors), norm, False
    scale = clip / norm
    return {name: tv if name in skip else _scaled(tv, scale) for name, tv in vectors.items()}, norm, True


def _scaled(tv: TaskVector, scale: float) -> TaskVector:
    return TaskVector({k: (t * scale).to(t.dtype) if t.is_floating_point() else t for k, t in tv.items()})
