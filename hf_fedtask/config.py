"""`RunConfig`: every setting of a federated run, loadable from YAML and overridable by CLI flags
(each field `foo_bar` is the flag `--foo-bar`), like torchtune configs or HF `TrainingArguments`.

The strategy's own options live in its config class (`hf_fedtask.strategies.configs`); a run holds
the strategy name and `strategy_options`. In YAML they may be given nested (`strategy_options:`) or flat
beside the other keys; an option the chosen strategy does not have is an error.

Each setting has one name throughout hf_fedtask, its field's here (`local_epochs`, `local_steps`,
`optimizer`, ...); transformers' names (`num_train_epochs`, `max_steps`, `optim`) appear only where the
local trainer builds its `TrainingArguments` (`hf_fedtask.client.trainer`).

This module imports no torch, datasets, transformers or peft (the names it checks come from light modules:
`hf_fedtask.core.names`, `hf_fedtask.strategies.configs`), so that `hf-fedtask --help` and config checks
start in a fraction of a second; `tests/test_cli_startup.py` holds it to that.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from hf_fedtask.client.round_schedule import ROUND_SCHEDULES
from hf_fedtask.core.fields import allowed_values, check_fields, field_type, option
from hf_fedtask.core.names import BAD_UPLOADS, BNB_4BIT_QUANT_TYPES, MIXED_PRECISIONS, OUTPUT_SPACES, PARTITIONS
from hf_fedtask.data.builtin_tasks import SUITES
from hf_fedtask.errors import ConfigError
from hf_fedtask.model.backbone import DEFAULT_BASE_MODEL, PEFT_METHODS
from hf_fedtask.strategies.configs import StrategyConfig
from hf_fedtask.strategies.registry import build_strategy_config, strategy_config_class, strategy_configs

OPTIMIZERS = ("adamw_torch", "sgd")  # transformers' `optim` names
CLIENT_LOOPS = ("auto", "trainer", "lean")
# transformers' `lr_scheduler_type` names that need no `lr_scheduler_kwargs` (so not cosine_with_min_lr,
# warmup_stable_decay, reduce_lr_on_plateau, ...)
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass
class RunConfig:
    """Every setting of a run, each with its help (the `hf-fedtask run` flag's) and its allowed values,
    checked on construction (`hf_fedtask.core.fields`): a bad value is one ConfigError naming it."""

    # what to run
    strategy: str = option("fedavg", "the federated algorithm: " + ", ".join(sorted(strategy_configs())) +
                           " (its options: the strategy options below)")
    strategy_options: dict = option({}, "the options set for the strategy (flat flags on the CLI, flat or nested "
                                    "keys in YAML)")
    suite: str | None = option("builtin-8", f"builtin task suite: {', '.join(SUITES)}; one client per task by "
                               "default (ignored when --tasks is given)")
    tasks: list[str] | None = option(None, "task refs, one task each: builtin task names, local dataset folders or "
                                     "Hub dataset ids (repo_id:config picks a config); replaces --suite")
    output_dir: str = option("runs/default", "the run folder: config, checkpoint, metrics, plots, adapters")
    # model
    base_model: str = option(DEFAULT_BASE_MODEL, "the pretrained classifier's Hub id or local folder")
    base_model_id: str | None = option(None, "the portable Hub id to record in exports when --base-model is a "
                                       "local folder")
    peft_method: str = option("lora", "the PEFT modules trained and exchanged (full: the whole backbone; probe: "
                              "the head alone)", choices=PEFT_METHODS)
    lora_r: int = option(8, "LoRA rank (with the strategy option lora_ranks: the server's global rank, each client "
                         "training at its own; bottleneck: the adapter's width)", minimum=1)
    lora_alpha: int = option(16, "LoRA alpha (the update is scaled by alpha / r)", minimum=1)
    lora_dropout: float = option(0.0, "dropout on the LoRA path", minimum=0.0, maximum=1.0)
    target_modules: list[str] | None = option(None, "module names the PEFT layers wrap (default: PEFT's for the "
                                              "architecture, e.g. query value for BERT)")
    num_virtual_tokens: int = option(20, "virtual tokens of prompt and prefix tuning", minimum=1)
    max_length: int = option(32, "tokens per text input (longer ones are truncated)", minimum=1)
    load_in_4bit: bool = option(False, "QLoRA: load the base model's linear layers in 4-bit NF4 through bitsandbytes "
                                "(LoRA methods, CUDA); exports stay adapters over the unquantized base id")
    load_in_8bit: bool = option(False, "load the base model's linear layers in 8-bit through bitsandbytes "
                                "(LoRA methods, CUDA); exports stay adapters over the unquantized base id")
    bnb_4bit_quant_type: str = option("nf4", "with --load-in-4bit: bitsandbytes' 4-bit data type, nf4 (QLoRA's) or "
                                      "fp4 (BitsAndBytesConfig's default)", choices=BNB_4BIT_QUANT_TYPES)
    bnb_4bit_use_double_quant: bool = option(True, "with --load-in-4bit: quantize the quantization constants too "
                                             "(QLoRA's double quantization; off in BitsAndBytesConfig's default)")
    # where it runs
    device: str = option("auto", "where the host model runs: auto (Accelerate's choice; under a multi-process launch "
                         "this rank's GPU, else the CPU) | cpu | cuda | cuda:N")
    mixed_precision: str = option("no", "mixed precision of local training and evaluation, through Accelerate; task "
                                  "vectors, server state and aggregation stay fp32", choices=MIXED_PRECISIONS)
    # federation
    num_clients: int | None = option(None, "clients in the federation (default: one per task)", minimum=1)
    rounds: int = option(3, "communication rounds", minimum=1)
    participation: float = option(1.0, "share of the clients sampled each round (seeded)", minimum=0.0, maximum=1.0,
                                  exclusive_minimum=True)
    zeta: float = option(0.0, "task allocation: 0 = one task per client; > 0 = Dirichlet(zeta) over clients per "
                         "task (smaller: fewer holders)", minimum=0.0)
    partition: str = option("iid", "how a task's training split is divided among its holders: iid | dirichlet "
                            "(label skew, --alpha) | classes (--classes-per-client labels each)", choices=PARTITIONS)
    output_space: str = option("per_task", "classification head: per_task (one per task) | max | union (one head "
                               "shared by all tasks)", choices=OUTPUT_SPACES)
    alpha: float = option(0.5, "Dirichlet concentration of --partition dirichlet (smaller: more label skew)",
                          minimum=0.0, exclusive_minimum=True)
    classes_per_client: int = option(2, "labels each holder gets under --partition classes", minimum=1)
    min_samples: int = option(8, "training samples every (client, task) pair must get, else the partition fails",
                              minimum=0)
    builtin_train_size: int | None = option(None, "training rows of each builtin task, drawn from its pool "
                                            "(default 400; the test rows stay the same; builtin tasks only)",
                                            minimum=2)
    max_train_samples: int | None = option(None, "cap each task's train split at a seeded subset (quick runs; "
                                           "default: all)", minimum=1)
    max_test_samples: int | None = option(None, "evaluate on a seeded subset of each task's test split (default: all)",
                                          minimum=1)
    comm_budget_mb: float | None = option(None, "communication budget in MB of 2^20 bytes, both directions over "
                                          "every round, as FlowerTune LLM counts its 200,000 MB: a run whose rounds "
                                          "would need more is refused before training, and a round that would pass "
                                          "it is not started (default: no budget)", minimum=0.0,
                                          exclusive_minimum=True)
    exclude_clients: list[int] = option([], "clients that never take part (a retraining reference); at least one "
                                        "client must remain", minimum=0)
    # client-level differential privacy (hf_fedtask.privacy; McMahan et al. 2018): each client's whole upload
    # clipped to L2 norm dp_clip, Gaussian noise dp_noise_multiplier·dp_clip on every aggregated sum, uniform
    # weights, ε at dp_delta accounted by dp-accounting; strategies declaring Capabilities.client_dp only
    dp_clip: float | None = option(None, "client-level DP: clip each client's whole upload to this L2 norm C (turns "
                                   "DP on; give --dp-noise-multiplier or --dp-epsilon too)", minimum=0.0,
                                   exclusive_minimum=True)
    dp_noise_multiplier: float | None = option(None, "client-level DP: noise multiplier σ, Gaussian noise of std σ·C "
                                               "on every aggregated sum (ε is reported; 0: clipping only, ε = ∞)",
                                               minimum=0.0)
    dp_epsilon: float | None = option(None, "client-level DP: target ε at --dp-delta; σ is calibrated by dp-accounting "
                                      "before training for the run's rounds and client sampling (resumed with "
                                      "other --rounds: recalibrated for the rounds left, the rounds run counted at "
                                      "their σ)", minimum=0.0, exclusive_minimum=True)
    dp_delta: float = option(1e-5, "client-level DP: the δ of the (ε, δ) reported or targeted", minimum=0.0,
                             maximum=1.0, exclusive_minimum=True, exclusive_maximum=True)
    dp_noise: str = option("server", "client-level DP: where the noise is drawn: server (central) | clients (each of "
                           "the h contributors to a sum adds N(0, σ²C²/h); needs secure aggregation, e.g. fedyolo "
                           "--secure-aggregation)",
                           choices=("server", "clients"))
    dp_noise_seed: int | None = option(None, "client-level DP: seed of the noise and of the client sample, for "
                                       "reproducible tests only: anyone who knows it can remove the noise and knows "
                                       "who was sampled (default: secret os.urandom keys)",
                                       minimum=0)
    # backdoor protocol (F²L²): one client's training data all carry a trigger and the target label;
    # evaluation adds each task's backdoor success rate on the triggered test inputs of other classes
    backdoor_client: int = option(-1, "backdoor protocol: the client whose training data all carry the trigger and "
                                  "the target label (-1: no backdoor)", minimum=-1)
    backdoor_target: int = option(0, "backdoor protocol: the label the triggered inputs are given", minimum=0)
    backdoor_trigger: int = option(7, "backdoor protocol: the trigger's size (images: side of a white square at the "
                                   "bottom right, in pixels; texts: trigger words)", minimum=1)
    # local training (transformers' TrainingArguments, built in hf_fedtask.client.trainer)
    local_epochs: float = option(1.0, "epochs over a task's local data per round (TrainingArguments' "
                                 "num_train_epochs)", minimum=0.0)
    local_steps: int = option(-1, "optimizer steps per task per round; > 0 overrides --local-epochs "
                              "(TrainingArguments' max_steps)", minimum=-1)
    batch_size: int = option(32, "local training batch size", minimum=1)
    learning_rate: float = option(5e-3, "local learning rate (with --lr-round-schedule cosine: the maximum, "
                                  "annealed round by round)", minimum=0.0)
    lr_round_schedule: str = option("constant", "the clients' learning rate round by round: constant "
                                    "(--learning-rate every round) | cosine (round r of R starts at "
                                    "min + (max - min)(1 + cos(pi r / R)) / 2, max --learning-rate, min "
                                    "--learning-rate-min, as FlowerTune LLM's cosine_annealing; such a run resumes "
                                    "only with its --rounds)", choices=ROUND_SCHEDULES)
    learning_rate_min: float = option(0.0, "with --lr-round-schedule cosine: the last round's learning rate",
                                      minimum=0.0)
    lr_scheduler: str = option("linear", "local learning-rate schedule, restarted every round (TrainingArguments' "
                               "lr_scheduler_type)", choices=LR_SCHEDULERS)
    warmup_steps: int = option(0, "local warmup steps of the schedule", minimum=0)
    weight_decay: float = option(0.0, "local decoupled weight decay", minimum=0.0)
    gradient_accumulation_steps: int = option(1, "batches accumulated per optimizer step", minimum=1)
    optimizer: str = option("adamw_torch", "local optimizer (TrainingArguments' optim)", choices=OPTIMIZERS)
    max_grad_norm: float = option(1.0, "gradient clipping norm; 0 turns it off", minimum=0.0)
    client_loop: str = option("auto", "the local training loop: trainer (a transformers Trainer per client and task) "
                              "| lean (the same optimizer steps, bit for bit, without the Trainer's per-call setup; "
                              "refuses fp16) | auto (lean where it applies)", choices=CLIENT_LOOPS)
    batch_clients: str = option("auto", "in-process FedAvg rounds: auto (train a round's clients of one task and "
                                "data size together, K copies of the model in one vectorized step, where the step "
                                "has no randomness (no dropout), inputs are fixed-shape and no convolution trains: "
                                "equal to one at a time up to float rounding) | off", choices=("auto", "off"))
    # bookkeeping
    eval_batch_size: int = option(128, "evaluation batch size", minimum=1)
    # evaluating every test split is a large share of a round on a CPU (docs/results/matu.md: the main job);
    # eval_every changes no training result, so a run may resume with another k
    eval_every: int = option(1, "evaluate the test splits every k rounds and always after the last", minimum=1)
    generation_eval: bool = option(False, "causal LM: also score each task's greedy answers once at the end, by "
                                   "exact match with its label word (results.json's exact_match) or, for a "
                                   "free-text task, by ROUGE-L with its reference response (rougeL)")
    seed: int = option(0, "seed of the partition, the PEFT init, sampling and local training", minimum=0)
    training_seed: int | None = option(None, "seed of the clients' local training alone (batch order, dropout; "
                                       "default: `seed`): another value repeats a run on the same partition, "
                                       "initialization and server data in another training order, which measures "
                                       "a result's run-to-run spread (as transformers' data_seed does for a "
                                       "Trainer)", minimum=0)
    report_to: list[str] = option([], "Accelerate trackers to log each round's metrics to, e.g. tensorboard wandb "
                                  "(logs under OUTPUT_DIR/logs)")
    export: bool = option(True, "write each task's PEFT adapter (and the strategy's exports) when the run ends")
    save_payloads: bool = option(False, "keep every round's uplink/downlink bytes under OUTPUT_DIR/payloads (audits)")
    bad_uploads: str = option("drop", "a client reply the server refuses (another client's id, a past round, tasks or "
                              "counts it does not hold, wrong tensors): drop (leave the client out of the round, the "
                              "reason in metrics.jsonl) | stop (end the run before the round is written, exit 2)",
                              choices=BAD_UPLOADS)

    # fields that may change between a run and its resumption without making it a different run
    RESUMABLE_CHANGES: typing.ClassVar[tuple[str, ...]] = (
        "output_dir", "rounds", "report_to", "export", "eval_batch_size", "eval_every", "save_payloads", "device",
        "generation_eval", "bad_uploads", "client_loop",
        "comm_budget_mb")

    def __post_init__(self):
        check_fields(self)  # types, choices and ranges of every field
        if not self.tasks and not self.suite:
            raise ConfigError("config: give `suite` or `tasks`")
        if not self.tasks and self.suite not in SUITES:  # a suite beside `tasks` is ignored ("" clears it)
            raise ConfigError(f"config: suite: must be one of {', '.join(SUITES)}, got {self.suite!r}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"config: device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.client_loop == "lean" and self.mixed_precision == "fp16":
            raise ConfigError("config: client_loop: lean does not reproduce fp16's gradient scaler: use trainer or "
                              "auto (which trains fp16 runs with the Trainer)")
        if self.lr_round_schedule == "constant" and self.learning_rate_min != 0.0:
            raise ConfigError(f"config: learning_rate_min: {self.learning_rate_min} has no effect with "
                              "lr_round_schedule constant; set lr_round_schedule: cosine or leave it out")
        if self.learning_rate_min > self.learning_rate:
            raise ConfigError(f"config: learning_rate_min: {self.learning_rate_min} is above learning_rate "
                              f"{self.learning_rate} (the cosine anneals from learning_rate down to it)")
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("config: load_in_4bit and load_in_8bit exclude each other: choose one")
        for key, default in (("bnb_4bit_quant_type", "nf4"), ("bnb_4bit_use_double_quant", True)):
            if not self.load_in_4bit and getattr(self, key) != default:
                raise ConfigError(f"config: {key}: {getattr(self, key)!r} has no effect without load_in_4bit; set "
                                  "load_in_4bit: true or leave it out")
        self._check_clients()
        typed = self.strategy_config  # validates the strategy and its options
        self.strategy_options = {k: getattr(typed, k) for k in self.strategy_options}  # as given, typed

    @property
    def client_count(self) -> int:
        """The number of clients in the federation: `num_clients`, else one per task."""
        return self.num_clients or len(self.tasks or SUITES[self.suite])

    def _check_clients(self) -> None:
        """Client ids name clients of this run, and exclude_clients leaves at least one to take part."""
        n = self.client_count
        for name, ids in (("exclude_clients", self.exclude_clients), ("backdoor_client", [self.backdoor_client])):
            outside = [k for k in ids if k >= n]
            if outside:
                raise ConfigError(f"config: {name}: client {outside[0]} is outside this run's {n} clients (0..{n - 1})")
        if len(set(self.exclude_clients)) >= n:
            raise ConfigError(f"config: exclude_clients: {self.exclude_clients} leaves none of this run's {n} clients "
                              "to take part")

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
        known = {f.name for f in dataclasses.fields(strategy_config_class(name))}
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
        defaults = {**RunConfig().flat(), **dataclasses.asdict(strategy_config_class(self.strategy)())}
        d = {k: v for k, v in self.flat().items() if k not in self.RESUMABLE_CHANGES and v != defaults.get(k)}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def local_training_seed(self) -> int:
        """The seed the clients' local training draws from: `training_seed`, else `seed`."""
        return self.seed if self.training_seed is None else self.training_seed

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
        own = {f.name: f for f in dataclasses.fields(strategy_config_class(strategy))}
        for key in [k for k in d if k not in known]:
            value = d.pop(key)
            if key in own:
                options[key] = value
            elif saved and key in _LEGACY_DEFAULTS and value == _LEGACY_DEFAULTS[key]:
                continue
            elif any(key in option_defaults(c) for c in strategy_configs().values()):
                build_strategy_config(strategy, {key: value})  # raises: names the strategies that have it
            else:
                names = [*known, *(n for c in strategy_configs().values() for n in option_defaults(c))]
                close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{source}: unknown key {key!r}{hint}")
        try:
            return cls(**d, strategy_options=options)
        except ConfigError as e:
            message = str(e).removeprefix("config: ")  # RunConfig's own errors: said of `source` instead
            raise ConfigError(message if message.startswith(source) else f"{source}: {message}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, saved: bool = False) -> RunConfig:
        return cls.from_dict(load_yaml(path), source=str(path), saved=saved)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save_yaml(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())


def option_defaults(strategy: type) -> dict:
    """A strategy's options with their defaults; `strategy` is its class or its config class."""
    return {f.name: f.default for f in dataclasses.fields(getattr(strategy, "config_class", strategy))}


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
    for config_class in strategy_configs().values():
        for f in dataclasses.fields(config_class):
            out.setdefault(f.name, (config_class, f))
    return out


def _field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _default_words(value) -> str | None:
    """A default as `--help` shows it (None: unset, which the help text explains where it matters)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) if value else "none"
    return str(value).replace("%", "%%")  # argparse formats help strings with %


def _default_note(defaults: dict[str, object]) -> str:
    """`(default: X)` for a flag whose owners (RunConfig, or the strategies having an option) default to
    X; `(default: X for a, b; Y for c)` where they differ."""
    by_value: dict[str, list[str]] = {}
    for owner, value in defaults.items():
        words = _default_words(value)
        if words is not None:
            by_value.setdefault(words, []).append(owner)
    if not by_value:
        return ""
    if len(by_value) == 1 and len(next(iter(by_value.values()))) == len(defaults):
        return f" (default: {next(iter(by_value))})"
    return " (default: " + "; ".join(f"{words} for {', '.join(owners)}" for words, owners in by_value.items()) + ")"


def _add_flag(parser, cls, f: dataclasses.Field, help_text: str | None, default_note: str = "") -> None:
    kind, is_list, _ = field_type(cls, f.name)
    flag = "--" + f.name.replace("_", "-")
    allowed = allowed_values(f)  # checked by the config (one line naming the key), not by argparse (usage + exit)
    if allowed and help_text is not None and kind is not bool:
        help_text = f"{help_text} {allowed}"
    if help_text is not None:
        help_text += default_note  # the flag's own default is None: only flags the user typed override YAML
    if kind is bool:
        parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif is_list:
        parser.add_argument(flag, dest=f.name, nargs="+", type=kind, default=None, help=help_text)
    else:
        parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per RunConfig field and per strategy option; defaults are None so that only flags the
    user typed override YAML. A strategy option's help names the strategies that have it."""
    parser.add_argument("--config", help="YAML file of RunConfig keys; flags override it")
    for f in dataclasses.fields(RunConfig):
        if f.name != "strategy_options":
            _add_flag(parser, RunConfig, f, f.metadata.get("help") if f.metadata else None,
                      _default_note({"run": _field_default(f)}))
    group = parser.add_argument_group("strategy options", "each is accepted only by the strategies that have it")
    for name, (cls, f) in _strategy_option_fields().items():
        owners = sorted(s for s, c in strategy_configs().items() if name in option_defaults(c))
        defaults = {s: option_defaults(strategy_configs()[s])[name] for s in owners}
        _add_flag(group, cls, f, f"{f.metadata.get('help', '')} [{', '.join(owners)}]", _default_note(defaults))


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
