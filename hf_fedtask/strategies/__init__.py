"""Federated strategies: one config dataclass and a few functions over task vectors each; see `base.py`."""

from hf_fedtask.strategies.base import (
    EVALUATE,
    QUERY,
    STRATEGIES,
    TRAIN,
    Capabilities,
    ClientJob,
    ClientRemoval,
    CompactExport,
    GlobalState,
    Linearized,
    Packaging,
    Strategy,
    StrategyConfig,
    build_strategy,
    build_strategy_config,
    configured_capabilities,
    head_name,
    hooks_declared,
    register_strategy,
    strategy_class,
)
from hf_fedtask.strategies.f2l2 import F2L2, F2L2Config
from hf_fedtask.strategies.fedavg import FedAvg, FedAvgConfig, FedProx, FedProxConfig
from hf_fedtask.strategies.fedper import FedPer, FedPerConfig
from hf_fedtask.strategies.fedyolo import FedYolo, FedYoloConfig
from hf_fedtask.strategies.matfl import MaTFL, MaTFLConfig
from hf_fedtask.strategies.matu import MaTU, MaTUConfig
from hf_fedtask.strategies.ntkfedavg import (
    NTKFedAvg,
    NTKFedAvgConfig,
    NTKFedProx,
    NTKFedProxConfig,
)
from hf_fedtask.strategies.scaffold import Scaffold, ScaffoldConfig
from hf_fedtask.strategies.tct import TCT, TCTConfig

__all__ = [
    "EVALUATE", "QUERY", "STRATEGIES", "TRAIN", "Capabilities", "ClientJob", "ClientRemoval", "CompactExport",
    "F2L2", "F2L2Config", "FedAvg", "FedAvgConfig", "FedPer",
    "FedPerConfig", "FedProx", "FedProxConfig", "FedYolo", "FedYoloConfig", "GlobalState", "MaTFL", "MaTFLConfig",
    "Linearized", "MaTU", "MaTUConfig", "NTKFedAvg", "NTKFedAvgConfig", "NTKFedProx", "NTKFedProxConfig",
    "Packaging", "Scaffold",
    "ScaffoldConfig", "Strategy", "TCT", "TCTConfig",
    "StrategyConfig", "build_strategy", "build_strategy_config", "configured_capabilities", "head_name",
    "hooks_declared", "register_strategy", "strategy_class",
]
