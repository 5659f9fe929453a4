"""Merge operators on task vectors: pure tensor functions, no I/O."""

from .linear import weighted_average

__all__ = ["weighted_average"]
