"""The strategy registry: each strategy's name -> its class (`STRATEGIES`, filled by `register_strategy`
when the strategy's module is imported) and its config class, known without importing that module.

The builtin strategies' config classes are declared in `BUILTIN_STRATEGIES`, next to the module that
defines each one. `RunConfig` and the CLI can then list, document and validate every strategy's options
from `hf_fedtask.strategies.configs` alone, without torch (`strategy_configs`, `build_strategy_config`).
`strategy_class` imports the strategies' modules when a strategy itself is needed, so the registry of
strategy classes is complete whenever it is read through it or through `hf_fedtask.strategies.STRATEGIES`.
"""

from __future__ import annotations

import dataclasses
import importlib

from hf_fedtask.errors import ConfigError
from hf_fedtask.strategies.configs import (
    F2L2Config,
    FedAvgLoRAConfig,
    FedPerConfig,
    FedProxLoRAConfig,
    FedYoloConfig,
    MaTFLConfig,
    MaTUConfig,
    NTKFedAvgConfig,
    NTKFedProxConfig,
    ScaffoldConfig,
    StrategyConfig,
    TCTConfig,
)

StrategyClass = type  # a `hf_fedtask.strategies.base.Strategy` subclass (base imports this registry, not back)

__all__ = ["BUILTIN_STRATEGIES", "STRATEGIES", "build_strategy_config", "load_builtin_strategies", "option_names",
           "register_strategy", "strategy_class", "strategy_config_class", "strategy_configs"]

# name -> (the module of hf_fedtask.strategies that defines and registers it, its config class), in the order
# the strategies register (the order of the CLI's strategy-option flags)
BUILTIN_STRATEGIES: dict[str, tuple[str, type[StrategyConfig]]] = {
    "fedavg": ("fedavg", FedAvgLoRAConfig),
    "fedprox": ("fedavg", FedProxLoRAConfig),
    "f2l2": ("f2l2.strategy", F2L2Config),
    "fedper": ("fedper", FedPerConfig),
    "fedyolo": ("fedyolo", FedYoloConfig),
    "matfl": ("matfl", MaTFLConfig),
    "matu": ("matu", MaTUConfig),
    "ntkfedavg": ("ntkfedavg", NTKFedAvgConfig),
    "ntkfedprox": ("ntkfedavg", NTKFedProxConfig),
    "scaffold": ("scaffold", ScaffoldConfig),
    "tct": ("tct", TCTConfig),
}

STRATEGIES: dict[str, StrategyClass] = {}
"""The registered strategy classes by name. It holds the builtins once their modules are imported: read it
as `hf_fedtask.strategies.STRATEGIES` (which imports them) or look a strategy up with `strategy_class`."""


def register_strategy(cls: StrategyClass) -> StrategyClass:
    """Class decorator: register `cls` under `cls.name`. A builtin strategy must register with the config
    class `BUILTIN_STRATEGIES` declares for it, the one `RunConfig` and the CLI validate its options with."""
    if not (isinstance(cls.config_class, type) and issubclass(cls.config_class, StrategyConfig)):
        raise TypeError(f"{cls.__name__}.config_class must be a StrategyConfig subclass")
    declared = BUILTIN_STRATEGIES.get(cls.name)
    if declared is not None and declared[1] is not cls.config_class:
        raise TypeError(f"{cls.__name__}.config_class is {cls.config_class.__name__}, but BUILTIN_STRATEGIES "
                        f"(hf_fedtask.strategies.registry) declares {declared[1].__name__} for {cls.name!r}")
    STRATEGIES[cls.name] = cls
    return cls


def load_builtin_strategies() -> dict[str, StrategyClass]:
    """Import the builtin strategies' modules (torch and all), which registers them; `STRATEGIES`."""
    for module in dict.fromkeys(module for module, _ in BUILTIN_STRATEGIES.values()):
        importlib.import_module(f"hf_fedtask.strategies.{module}")
    return STRATEGIES


def strategy_class(name: str) -> StrategyClass:
    """The strategy registered as `name` (the builtins are imported if it is not there yet)."""
    if name not in STRATEGIES:
        load_builtin_strategies()
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]


def strategy_configs() -> dict[str, type[StrategyConfig]]:
    """Every strategy's config class by name, without importing any strategy: the builtins' (in their
    registration order), then those of strategies registered since."""
    configs = {name: config for name, (_, config) in BUILTIN_STRATEGIES.items()}
    configs.update((name, cls.config_class) for name, cls in STRATEGIES.items())
    return configs


def strategy_config_class(name: str) -> type[StrategyConfig]:
    """The config class of strategy `name` (the same error as `strategy_class` for an unknown name)."""
    configs = strategy_configs()
    if name not in configs:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(sorted(configs))}")
    return configs[name]


def option_names(config_class: type[StrategyConfig]) -> list[str]:
    return [f.name for f in dataclasses.fields(config_class)]


def build_strategy_config(name: str, options: dict) -> StrategyConfig:
    """The typed config of strategy `name`; an option it does not have is an error naming who has it."""
    configs = strategy_configs()
    cls = strategy_config_class(name)
    known = option_names(cls)
    for key in options:
        if key not in known:
            owners = sorted(n for n, c in configs.items() if key in option_names(c))
            hint = f" (an option of {', '.join(owners)})" if owners else ""
            theirs = f"; its options: {', '.join(known)}" if known else "; it has no options"
            raise ConfigError(f"strategy {name!r} does not support option {key!r}{hint}{theirs}")
    try:
        return cls(**options)
    except TypeError as e:
        raise ConfigError(f"strategy {name!r}: {e}") from None
