"""Merge operators on task vectors: pure tensor functions, no I/O."""

from .linear import weighted_average
from .ties import agreement_mask, magnitude_prune, sign_similarity, task_arithmetic, ties

__all__ = ["agreement_mask", "magnitude_prune", "sign_similarity", "task_arithmetic", "ties", "weighted_average"]
