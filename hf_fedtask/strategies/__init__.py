"""Federated strategies: one config dataclass and a few functions over task vectors each; see `base.py`.

The config classes and the registry's lookups are light (`configs.py`, `registry.py`: no torch), so that
`RunConfig` and `hf-fedtask --help` do not import the strategies. The strategies and the rest of `base.py`
are imported on first use (PEP 562 `__getattr__`), and then all of them at once, so that `STRATEGIES` is
complete whenever it is read from here."""

from hf_fedtask.core.lazy import lazy_attributes
from hf_fedtask.strategies.configs import (
    F2L2Config,
    FedAvgConfig,
    FedPerConfig,
    FedProxConfig,
    FedYoloConfig,
    MaTFLConfig,
    MaTUConfig,
    NTKFedAvgConfig,
    NTKFedProxConfig,
    ScaffoldConfig,
    StrategyConfig,
    TCTConfig,
)
from hf_fedtask.strategies.registry import (
    build_strategy_config,
    load_builtin_strategies,
    register_strategy,
    strategy_class,
    strategy_configs,
)

# name -> the module of hf_fedtask.strategies that defines it (imported on first use, with every strategy)
_LAZY = {
    **dict.fromkeys(("EVALUATE", "QUERY", "TRAIN", "Capabilities", "ClientJob", "ClientRemoval", "CompactExport",
                     "GlobalState", "Linearized", "Packaging", "Strategy", "build_strategy", "configured_capabilities",
                     "head_name", "hooks_declared"), "base"),
    "STRATEGIES": "registry",
    "F2L2": "f2l2",
    "FedAvg": "fedavg",
    "FedProx": "fedavg",
    "FedPer": "fedper",
    "FedYolo": "fedyolo",
    "MaTFL": "matfl",
    "MaTU": "matu",
    "NTKFedAvg": "ntkfedavg",
    "NTKFedProx": "ntkfedavg",
    "Scaffold": "scaffold",
    "TCT": "tct",
}


# every builtin registered before any of them (or STRATEGIES) is handed out
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, before=load_builtin_strategies)

__all__ = [  # the light names above, then the lazy ones
    "F2L2Config", "FedAvgConfig", "FedPerConfig", "FedProxConfig", "FedYoloConfig", "MaTFLConfig", "MaTUConfig",
    "NTKFedAvgConfig", "NTKFedProxConfig", "ScaffoldConfig", "StrategyConfig", "TCTConfig", "build_strategy_config",
    "register_strategy", "strategy_class", "strategy_configs", *_LAZY,
]
