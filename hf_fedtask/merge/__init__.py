"""Merge operators on task vectors: pure tensor functions, no I/O."""

from .dare import dare_linear, dare_ties, random_prune
from .linear import weighted_average
from .ties import (
    agreement_mask,
    magnitude_prune,
    sign_similarity,
    task_arithmetic,
    ties,
)
from .unify import Unified, unify

__all__ = [
    "Unified",
    "agreement_mask",
    "dare_linear",
    "dare_ties",
    "magnitude_prune",
    "random_prune",
    "sign_similarity",
    "task_arithmetic",
    "ties",
    "unify",
    "weighted_average",
]
