"""`RunConfig`: every setting of a federated run, loadable from YAML and overridable by CLI flags
(each field `foo_bar` is the flag `--foo-bar`), like torchtune configs or HF `TrainingArguments`."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hf_fedtask.model.backbone import DEFAULT_BASE_MODEL
from hf_fedtask.errors import ConfigError


@dataclass
class RunConfig:
    # what to run
    strategy: str = "fedavg"
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
    # federation
    num_clients: int | None = None  # default: one client per task
    rounds: int = 3
    participation: float = 1.0
    zeta: float = 0.0  # task allocation: 0 = one task per client; > 0 = Dirichlet over clients per task
    partition: str = "iid"  # within a task: iid | dirichlet | classes
    alpha: float = 0.5
    classes_per_client: int = 2
    min_samples: int = 8
    max_train_samples: int | None = None  # cap each task's train split (quick runs)
    # local training
    local_epochs: float = 1.0
    local_steps: int = -1
    batch_size: int = 32
    learning_rate: float = 5e-3
    lr_scheduler: str = "linear"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    gradient_accumulation_steps: int = 1
    # server / strategy
    server_lr: float = 1.0
    proximal_mu: float = 0.01
    forget_tasks: list[str] | None = None  # unlearning: negate the updates of clients holding these tasks
    track_task_vectors: bool = False  # FedAvg family: keep each task's accumulated vector (one-shot negation)
    # NTKFedAvg (algorithms.md §5)
    linearize_at: str = "server"  # server (re-linearize every round) | pretrained
    linearization: str = "network"  # network | lora_layers (L-LoRA)
    # FedYolo (algorithms.md §4)
    share: str = "none"  # modules shared by all tasks: none | half (first ⌊L/2⌋ blocks) | all
    secure_aggregation: bool = False  # privacy variant: K-task slot uploads, pairwise-masked; the server sees sums
    sample_weighted: bool = False  # weight FedYolo's per-task means by sample counts (the paper: unweighted)
    # MaTU (algorithms.md §3)
    rho: float = 0.4  # agreement-mask threshold
    kappa: int = 2  # cross-task neighbours per task
    epsilon: float = 0.5  # minimum sign similarity of a neighbour
    combine: str = "s_normalized"  # sum | mean | s_normalized
    rescaler: str = "global_sum"  # global_sum | per_tensor_mean
    include_self: bool = False
    wire_dtype: str = "float32"  # float32 | bfloat16 (the unified vector on the wire)
    # baselines
    personal_blocks: int = 1  # FedPer: last transformer blocks kept on the client (with the heads)
    group_size: int = 3  # MaT-FL-style: peers (self included) each client aggregates with
    # bookkeeping
    eval_batch_size: int = 128
    seed: int = 0
    report_to: list[str] = field(default_factory=list)  # e.g. [tensorboard]; any Accelerate tracker
    export: bool = True
    save_payloads: bool = False  # keep every round's uplink/downlink bytes under output_dir/payloads (audits)

    # fields that may change between a run and its resumption without making it a different run
    RESUMABLE_CHANGES: typing.ClassVar[tuple[str, ...]] = ("output_dir", "rounds", "report_to", "export", "eval_batch_size",
                                                             "save_payloads")

    def __post_init__(self):
        if not self.tasks and not self.suite:
            raise ConfigError("config: give `suite` or `tasks`")
        positive = ("rounds", "batch_size", "max_length", "eval_batch_size", "gradient_accumulation_steps")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"config: {name} must be positive, got {getattr(self, name)}")
        if not 0 < self.participation <= 1:
            raise ConfigError(f"config: participation must be in (0, 1], got {self.participation}")
        if self.zeta < 0:
            raise ConfigError(f"config: zeta must be >= 0, got {self.zeta}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of the settings that define the run's result (not where it is written or for how
        long). Only values that differ from the defaults count, so a release that adds a setting
        (at a default that keeps the old behaviour) still resumes the runs of the previous one."""
        defaults = RunConfig().to_dict()
        d = {k: v for k, v in self.to_dict().items() if k not in self.RESUMABLE_CHANGES and v != defaults[k]}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def same_run(self, other: RunConfig) -> bool:
        """True when `other` would produce the same result (it may differ in RESUMABLE_CHANGES)."""
        return self.fingerprint() == other.fingerprint()

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                raise ConfigError(f"{source}: unknown key {key!r}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> RunConfig:
        return cls.from_dict(load_yaml(path), source=str(path))

    def save_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def load_yaml(path: str | Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read YAML config ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a mapping of keys to values")
    return data


def _flag_type(annotation) -> tuple[type, bool]:
    """(element type, is_list) for a field annotation such as `int | None` or `list[str] | None`."""
    hint = typing.get_type_hints(RunConfig)[annotation]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    base = args[0]
    if typing.get_origin(base) is list:
        return typing.get_args(base)[0], True
    return base, False


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per RunConfig field; defaults are None so only flags the user typed override YAML."""
    parser.add_argument("--config", help="YAML file of RunConfig keys; flags override it")
    for f in dataclasses.fields(RunConfig):
        kind, is_list = _flag_type(f.name)
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        elif is_list:
            parser.add_argument(flag, dest=f.name, nargs="+", type=kind, default=None)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None)


def config_from_args(args: argparse.Namespace, defaults: dict | None = None) -> RunConfig:
    """`defaults` (e.g. a recipe's), then the `--config` YAML, then the flags the user typed."""
    values = dict(defaults or {})
    if getattr(args, "config", None):
        given = load_yaml(args.config)
        RunConfig.from_dict({**values, **given}, source=args.config)  # validate keys before merging flags
        values.update(given)
    for f in dataclasses.fields(RunConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    if "tasks" in values and values["tasks"] and "suite" not in values:
        values["suite"] = None
    return RunConfig.from_dict(values, source=getattr(args, "config", None) or "flags")
