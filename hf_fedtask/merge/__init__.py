"""Merge operators on task vectors: pure tensor functions, no I/O."""

from hf_fedtask.merge.dare import dare_linear, dare_ties, random_prune
from hf_fedtask.merge.linear import weighted_average
from hf_fedtask.merge.ties import (
    agreement_mask,
    magnitude_prune,
    sign_similarity,
    task_arithmetic,
    ties,
)
from hf_fedtask.merge.unify import Unified, unify

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
