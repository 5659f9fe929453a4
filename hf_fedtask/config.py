"""`RunConfig`: every setting of a federated run, loadable from YAML and overridable by CLI flags
(each field `foo_bar` is the flag `--foo-bar`), like torchtune configs or HF `TrainingArguments`.

The strategy's own options live in its config class (`hf_fedtask.strategies`); a run holds the
strategy name and `strategy_options`. In YAML they may be given nested (`strategy_options:`) or flat
beside the other keys; an option the chosen strategy does not have is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hf_fedtask.core.fields import check_fields, field_type, option
from hf_fedtask.errors import ConfigError
from hf_fedtask.model.backbone import DEFAULT_BASE_MODEL
from hf_fedtask.model.device import MIXED_PRECISIONS
from hf_fedtask.model.output_space import OUTPUT_SPACES
from hf_fedtask.strategies import (
    STRATEGIES,
    StrategyConfig,
    build_strategy_config,
    strategy_class,
)

OPTIMIZERS = ("adamw_torch", "sgd")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass
class RunConfig:
    # what to run
    strategy: str = "fedavg"
    strategy_options: dict = field(default_factory=dict)  # the options set for the strategy (flat flags on the CLI)
    suite: str | None = "builtin-8"
    tasks: list[str] | None = None  # task refs (builtin names, local paths, Hub ids); overrides `suite`
    output_dir: str = "runs/default"
    # model
    base_model: str = DEFAULT_BASE_MODEL
    base_model_id: str | None = None  # portable Hub id to record when `base_model` is a local folder
    peft_method: str = "lora"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    target_modules: list[str] | None = None
    num_virtual_tokens: int = 20
    max_length: int = 32
    load_in_4bit: bool = option(False, "QLoRA: load the base model's linear layers in 4-bit NF4 through bitsandbytes "
                                "(LoRA methods, CUDA); exports stay adapters over the unquantized base id")
    load_in_8bit: bool = option(False, "load the base model's linear layers in 8-bit through bitsandbytes (LoRA methods, "
                                "CUDA); exports stay adapters over the unquantized base id")
    # where it runs
    device: str = option("auto", "where the host model runs: auto (Accelerate's choice; under a multi-process launch "
                         "this rank's GPU, else the CPU) | cpu | cuda | cuda:N")
    mixed_precision: str = option("no", "mixed precision of local training and evaluation, through Accelerate; task "
                                  "vectors, server state and aggregation stay fp32", choices=MIXED_PRECISIONS)
    # federation
    num_clients: int | None = None  # default: one client per task
    rounds: int = 3
    participation: float = 1.0
    zeta: float = 0.0  # task allocation: 0 = one task per client; > 0 = Dirichlet over clients per task
    partition: str = "iid"  # within a task: iid | dirichlet | classes
    output_space: str = "per_task"  # classification head: per_task | max | union (one head shared by all tasks)
    alpha: float = 0.5
    classes_per_client: int = 2
    min_samples: int = 8
    max_train_samples: int | None = None  # cap each task's train split (quick runs)
    max_test_samples: int | None = None  # evaluate on a seeded subset of each task's test split
    exclude_clients: list[int] = field(default_factory=list)  # clients that never take part (a retraining reference)
    # backdoor protocol (F²L²): one client's training data all carry a trigger and the target label;
    # evaluation adds each task's backdoor success rate on the triggered test inputs of other classes
    backdoor_client: int = -1  # -1 = no backdoor
    backdoor_target: int = 0
    backdoor_trigger: int = 7  # images: side of a white square at the bottom right, in pixels; texts: trigger words
    # local training
    local_epochs: float = 1.0
    local_steps: int = -1
    batch_size: int = 32
    learning_rate: float = 5e-3
    lr_scheduler: str = "linear"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    gradient_accumulation_steps: int = 1
    optimizer: str = "adamw_torch"  # adamw_torch | sgd (transformers' `optim` names)
    max_grad_norm: float = 1.0  # gradient clipping; 0 turns it off
    # bookkeeping
    eval_batch_size: int = 128
    eval_every: int = 1  # evaluate the test splits every k rounds and always after the last (a CPU spends
    # up to ~40% of a round evaluating); it changes no training result, so a run may resume with another k
    seed: int = 0
    report_to: list[str] = field(default_factory=list)  # e.g. [tensorboard]; any Accelerate tracker
    export: bool = True
    save_payloads: bool = False  # keep every round's uplink/downlink bytes under output_dir/payloads (audits)

    # fields that may change between a run and its resumption without making it a different run
    RESUMABLE_CHANGES: typing.ClassVar[tuple[str, ...]] = ("output_dir", "rounds", "report_to", "export", "eval_batch_size",
                                                             "eval_every", "save_payloads", "device")

    def __post_init__(self):
        check_fields(self)
        if not self.tasks and not self.suite:
            raise ConfigError("config: give `suite` or `tasks`")
        positive = ("rounds", "batch_size", "max_length", "eval_batch_size", "eval_every", "gradient_accumulation_steps")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_clients is not None and self.num_clients < 1:
            raise ConfigError(f"config: num_clients must be at least 1, got {self.num_clients}")
        if not 0 < self.participation <= 1:
            raise ConfigError(f"config: participation must be in (0, 1], got {self.participation}")
        if self.zeta < 0:
            raise ConfigError(f"config: zeta must be >= 0, got {self.zeta}")
        if self.output_space not in OUTPUT_SPACES:
            raise ConfigError(f"config: output_space must be one of {', '.join(OUTPUT_SPACES)}, got {self.output_space!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"config: optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.backdoor_client < -1 or self.backdoor_target < 0 or self.backdoor_trigger < 1:
            raise ConfigError("config: backdoor_client must be >= -1, backdoor_target >= 0 and backdoor_trigger >= 1, got "
                              f"{self.backdoor_client}, {self.backdoor_target}, {self.backdoor_trigger}")
        if any(c < 0 for c in self.exclude_clients):
            raise ConfigError(f"config: exclude_clients must be client ids >= 0, got {self.exclude_clients}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"config: device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("config: load_in_4bit and load_in_8bit exclude each other: choose one")
        if self.max_grad_norm < 0:
            raise ConfigError(f"config: max_grad_norm must be >= 0, got {self.max_grad_norm}")
        typed = self.strategy_config  # validates the strategy and its options
        self.strategy_options = {k: getattr(typed, k) for k in self.strategy_options}  # as given, typed

    @property
    def strategy_config(self) -> StrategyConfig:
        """The strategy's typed options (an unknown strategy or option is a ConfigError)."""
        return build_strategy_config(self.strategy, dict(self.strategy_options))

    def with_options(self, **options) -> RunConfig:
        """A copy with some strategy options changed."""
        return dataclasses.replace(self, strategy_options={**self.strategy_options, **options})

    def for_strategy(self, name: str, **overrides) -> RunConfig:
        """This config run with strategy `name` (method comparisons): the strategy options that `name`
        also has carry over, the others are left behind; `overrides` are RunConfig keys or options."""
        known = {f.name for f in dataclasses.fields(strategy_class(name).config_class)}
        options = {k: v for k, v in self.strategy_options.items() if k in known}
        return RunConfig.from_dict({**self.common(), "strategy": name, "strategy_options": options, **overrides},
                                   source=f"strategy {name}")

    def common(self) -> dict:
        """The settings other than the strategy and its options."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("strategy", "strategy_options")}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flat(self) -> dict:
        """Every setting in one mapping (all the strategy's options, defaults included, beside the others)."""
        return {**self.common(), "strategy": self.strategy, **dataclasses.asdict(self.strategy_config)}

    def fingerprint(self) -> str:
        """Hash of the settings that define the run's result (not where it is written or for how
        long). Only values that differ from their defaults count, so a release that adds a setting
        (at a default that keeps the old behaviour) still resumes the runs of the previous one."""
        defaults = {**RunConfig().flat(), **dataclasses.asdict(strategy_class(self.strategy).config_class())}
        d = {k: v for k, v in self.flat().items() if k not in self.RESUMABLE_CHANGES and v != defaults.get(k)}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def same_run(self, other: RunConfig) -> bool:
        """True when `other` would produce the same result (it may differ in RESUMABLE_CHANGES)."""
        return self.fingerprint() == other.fingerprint()

    @classmethod
    def from_dict(cls, d: dict, source: str = "config", saved: bool = False) -> RunConfig:
        """Build from a mapping. Strategy options may be flat keys or under `strategy_options`.
        `saved`: a run folder's run_config.yaml written by an earlier release, which listed every
        strategy's options: those of other strategies are dropped when they hold their default."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        options = dict(d.pop("strategy_options", None) or {})
        if not isinstance(options, dict):
            raise ConfigError(f"{source}: strategy_options must be a mapping")
        strategy = d.get("strategy", cls.strategy)
        if not isinstance(strategy, str):
            raise ConfigError(f"{source}: strategy: expected a string, got {strategy!r}")
        own = {f.name: f for f in dataclasses.fields(strategy_class(strategy).config_class)}
        for key in [k for k in d if k not in known]:
            value = d.pop(key)
            if key in own:
                options[key] = value
            elif saved and key in _LEGACY_DEFAULTS and value == _LEGACY_DEFAULTS[key]:
                continue
            elif any(key in option_defaults(c) for c in STRATEGIES.values()):
                build_strategy_config(strategy, {key: value})  # raises: names the strategies that have it
            else:
                raise ConfigError(f"{source}: unknown key {key!r}")
        try:
            return cls(**d, strategy_options=options)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}" if not str(e).startswith(source) else str(e)) from None

    @classmethod
    def from_yaml(cls, path: str | Path, saved: bool = False) -> RunConfig:
        return cls.from_dict(load_yaml(path), source=str(path), saved=saved)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save_yaml(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())


def option_defaults(strategy: type) -> dict:
    return {f.name: f.default for f in dataclasses.fields(strategy.config_class)}


# every strategy option with the default it had as a flat RunConfig key before strategy configs
_LEGACY_DEFAULTS = {"server_lr": 1.0, "proximal_mu": 0.01, "forget_tasks": None, "track_task_vectors": False,
                    "linearize_at": "server", "linearization": "network", "share": "none",
                    "secure_aggregation": False, "sample_weighted": False, "rho": 0.4, "kappa": 2, "epsilon": 0.5,
                    "combine": "s_normalized", "rescaler": "global_sum", "include_self": False,
                    "wire_dtype": "float32", "personal_blocks": 1, "group_size": 3}


def load_yaml(path: str | Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read YAML config ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a mapping of keys to values")
    return data


def _strategy_option_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every strategy option name -> (config class declaring it, its field), first declaration wins."""
    out = {}
    for cls in STRATEGIES.values():
        for f in dataclasses.fields(cls.config_class):
            out.setdefault(f.name, (cls.config_class, f))
    return out


def _add_flag(parser, cls, f: dataclasses.Field, help_text: str | None) -> None:
    kind, is_list, _ = field_type(cls, f.name)
    flag = "--" + f.name.replace("_", "-")
    choices = f.metadata.get("choices") if f.metadata else None
    if kind is bool:
        parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif is_list:
        parser.add_argument(flag, dest=f.name, nargs="+", type=kind, default=None, help=help_text)
    else:  # choices are checked by the config (one line naming the key), not by argparse (usage + exit)
        if choices and help_text is not None:
            help_text = f"{help_text} {{{', '.join(map(str, choices))}}}"
        parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per RunConfig field and per strategy option; defaults are None so that only flags the
    user typed override YAML. A strategy option's help names the strategies that have it."""
    parser.add_argument("--config", help="YAML file of RunConfig keys; flags override it")
    for f in dataclasses.fields(RunConfig):
        if f.name != "strategy_options":
            _add_flag(parser, RunConfig, f, f.metadata.get("help") if f.metadata else None)
    group = parser.add_argument_group("strategy options", "each is accepted only by the strategies that have it")
    for name, (cls, f) in _strategy_option_fields().items():
        owners = sorted(s for s, c in STRATEGIES.items() if name in option_defaults(c))
        _add_flag(group, cls, f, f"{f.metadata.get('help', '')} [{', '.join(owners)}]")


def config_from_args(args: argparse.Namespace, defaults: dict | None = None) -> RunConfig:
    """`defaults` (e.g. a recipe's), then the `--config` YAML, then the flags the user typed."""
    values = dict(defaults or {})
    if getattr(args, "config", None):
        given = load_yaml(args.config)
        RunConfig.from_dict({**values, **given}, source=args.config)  # validate keys before merging flags
        values.update(given)
    for name in [f.name for f in dataclasses.fields(RunConfig)] + list(_strategy_option_fields()):
        given = getattr(args, name, None)
        if given is not None:
            values[name] = given
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")  # `accelerate launch --mixed_precision`
    if "mixed_precision" not in values and launcher in MIXED_PRECISIONS:
        values["mixed_precision"] = launcher
    if "tasks" in values and values["tasks"] and "suite" not in values:
        values["suite"] = None
    return RunConfig.from_dict(values, source=getattr(args, "config", None) or "flags")
