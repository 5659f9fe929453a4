"""Federated strategies, each a pair (client_update, server_aggregate); see `base.py`."""

from .base import (
    STRATEGIES,
    ClientJob,
    GlobalState,
    Strategy,
    build_strategy,
    head_name,
    register_strategy,
)
from .fedavg import FedAvg, FedProx
from .fedper import FedPer
from .fedyolo import FedYolo
from .matfl import MaTFL
from .matu import MaTU
from .ntkfedavg import NTKFedAvg, NTKFedProx

__all__ = [
    "STRATEGIES",
    "ClientJob",
    "FedAvg",
    "FedPer",
    "FedProx",
    "FedYolo",
    "GlobalState",
    "MaTFL",
    "MaTU",
    "NTKFedAvg",
    "NTKFedProx",
    "Strategy",
    "build_strategy",
    "head_name",
    "register_strategy",
]
