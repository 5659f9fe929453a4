"""Federated strategies, each a pair (client_update, server_aggregate); see `base.py`."""

from hf_fedtask.strategies.base import (
    STRATEGIES,
    ClientJob,
    GlobalState,
    Strategy,
    build_strategy,
    head_name,
    register_strategy,
)
from hf_fedtask.strategies.fedavg import FedAvg, FedProx
from hf_fedtask.strategies.fedper import FedPer
from hf_fedtask.strategies.fedyolo import FedYolo
from hf_fedtask.strategies.matfl import MaTFL
from hf_fedtask.strategies.matu import MaTU
from hf_fedtask.strategies.ntkfedavg import NTKFedAvg, NTKFedProx

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
