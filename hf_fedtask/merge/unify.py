"""EMR-style unification (MaTU §3, client side): one unified task vector for T task vectors plus a
binary mask and a scalar rescaler per task, from which each task's vector is approximately
recovered as λ_t·(m_t ⊙ τ).

    σ = sgn(Σ_t τ_t)                                   elected sign (0 where the sum is 0)
    μ[j] = max{|τ_t[j]| : sgn(τ_t[j]) = σ[j]}          largest agreeing magnitude
    τ = σ ⊙ μ
    m_t = 1[τ_t ⊙ τ > 0]
    λ_t = Σ|τ_t| / Σ|m_t ⊙ τ|                          ("global_sum", the paper's rescaler)
        or Σ_keys mean|τ_t[key]| / Σ_keys mean|m_t ⊙ τ[key]|   ("per_tensor_mean", EMR's code)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..taskvector import TaskVector
from .ties import check_compatible

RESCALERS = ("global_sum", "per_tensor_mean")


@dataclass
class Unified:
    vector: TaskVector
    masks: list[TaskVector]  # bool tensors, one TaskVector per task
    rescalers: list[float]

    def task_vector(self, t: int) -> TaskVector:
        """The approximation λ_t·(m_t ⊙ τ) of task t's vector."""
        return TaskVector({k: self.rescalers[t] * self.masks[t][k] * v for k, v in self.vector.items()})


def unify(vectors: Sequence[TaskVector], rescaler: str = "global_sum") -> Unified:
    if rescaler not in RESCALERS:
        raise ValueError(f"rescaler must be one of {RESCALERS}, got {rescaler!r}")
    check_compatible(vectors, [1.0] * len(vectors))
    unified, masks = {}, [{} for _ in vectors]
    for key in vectors[0]:
        sign = sum(tv[key] for tv in vectors).sign()
        magnitude = torch.zeros_like(sign)
        for tv in vectors:
            agreeing = tv[key].sign() == sign
            magnitude = torch.where(agreeing, torch.maximum(magnitude, tv[key].abs()), magnitude)
        unified[key] = sign * magnitude
        for i, tv in enumerate(vectors):
            masks[i][key] = tv[key] * unified[key] > 0
    rescalers = [_rescaler(tv, unified, m, rescaler) for tv, m in zip(vectors, masks)]
    return Unified(TaskVector(unified), [TaskVector(m) for m in masks], rescalers)


def _rescaler(tv: TaskVector, unified: dict, mask: dict, kind: str) -> float:
    if kind == "global_sum":
        num = sum(float(tv[k].abs().sum()) for k in unified)
        den = sum(float((unified[k] * mask[k]).abs().sum()) for k in unified)
    else:
        num = sum(float(tv[k].abs().mean()) for k in unified)
        den = sum(float((unified[k] * mask[k]).abs().mean()) for k in unified)
    return num / den if den > 0 else 0.0
