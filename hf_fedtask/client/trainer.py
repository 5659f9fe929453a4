"""Local training of one client on one task: a `transformers.Trainer` run on the shared in-memory
PEFT model, started from a given state and returning the trained state as tensors."""

from __future__ import annotations

import dataclasses
import gc
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch
from datasets import Dataset
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

from hf_fedtask.client.batched import BatchedLoop, NotBatchable
from hf_fedtask.client.lean import LeanLoop, lean_unsupported
from hf_fedtask.client.objectives import Objective
from hf_fedtask.client.round_schedule import round_learning_rate
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import ConfigError, ProtocolError
from hf_fedtask.model.device import hide_launch_from_trainers
from hf_fedtask.model.host import PeftHost


@dataclass
class LocalTrainingArgs:
    """The client optimiser recipe: RunConfig's local-training settings, under their RunConfig names and
    with no defaults of their own (`from_run`). `LocalTrainer` translates them into `TrainingArguments`."""

    local_epochs: float
    local_steps: int  # > 0 overrides local_epochs: a fixed number of optimizer steps per task per round
    batch_size: int
    learning_rate: float  # with lr_round_schedule cosine: the maximum, which `for_round` anneals
    lr_round_schedule: str  # constant | cosine (hf_fedtask.client.round_schedule)
    learning_rate_min: float  # cosine's last-round rate
    lr_scheduler: str
    warmup_steps: int
    weight_decay: float
    gradient_accumulation_steps: int
    max_grad_norm: float
    optimizer: str
    mixed_precision: str  # no | bf16 | fp16: Trainer's autocast; the parameters and task vectors stay fp32
    client_loop: str  # auto | trainer | lean (hf_fedtask.client.lean)
    batch_clients: str  # auto | off (hf_fedtask.client.batched)

    @classmethod
    def from_run(cls, config) -> LocalTrainingArgs:
        """The recipe of `config`'s local-training settings; `config` is a `hf_fedtask.config.RunConfig`
        (read by field name: the client layer does not import the config layer above it)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def for_round(self, round_: int, rounds: int) -> LocalTrainingArgs:
        """The recipe of round `round_` (1-based) of a `rounds`-round run: its learning rate the round schedule's
        (`lr_round_schedule`); this recipe itself where the schedule is constant."""
        rate = round_learning_rate(self.lr_round_schedule, round_, rounds, self.learning_rate, self.learning_rate_min)
        return self if rate == self.learning_rate else dataclasses.replace(self, learning_rate=rate)


@dataclass
class _HostDeviceArguments(TrainingArguments):
    """`TrainingArguments` that train on the host model's device. For one process, transformers would
    pick cuda:0 (and `DataParallel` over every visible GPU), while the shared host model may sit on
    cuda:N or, under a multi-process launch, on this rank's GPU; batches must reach the model's device."""

    host_device: str | None = None

    def __post_init__(self):
        super().__post_init__()
        # the run's setting, not `accelerate launch --mixed_precision` read from the environment
        self.mixed_precision = "fp16" if self.fp16 else "bf16" if self.bf16 else "no"

    @cached_property
    def _setup_devices(self) -> torch.device:
        device = TrainingArguments._setup_devices.func(self)  # Accelerate's state, as Trainer builds it
        if self.host_device is None:
            return device
        device = torch.device(self.host_device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # Accelerate's "cuda" (the current device) is then this one
            self._n_gpu = 1
        return device


def _length_grouping(grouped: bool) -> dict:
    """TrainingArguments for batches of alike lengths (a causal LM's instruction examples vary in length,
    so they pad little): `train_sampling_strategy` in recent transformers, `group_by_length` in older ones."""
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "train_sampling_strategy" in names:
        return {"train_sampling_strategy": "group_by_length" if grouped else "random"}
    return {"group_by_length": grouped}


class _LearningRateSum(TrainerCallback):
    """Σ_k η_k over the optimizer steps taken: what SCAFFOLD's option-II control update divides
    the local movement by (K·η_l for a constant rate, exact under a schedule)."""

    def __init__(self):
        self.total = 0.0

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.total += float(optimizer.param_groups[0]["lr"])


class _ObjectiveTrainer(Trainer):
    """Trainer whose loss goes through the strategy's local objectives (`hf_fedtask.client.objectives`)."""

    def __init__(self, *args, objectives: Sequence[Objective] = (), params: dict | None = None,
                 group_by_length: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_by_length = group_by_length
        self.objectives = list(objectives)
        for objective in self.objectives:
            objective.start(params or {})

    def _get_train_sampler(self, train_dataset=None):
        """transformers' `LengthGroupedSampler`, its lengths read from the Arrow column at once: Trainer
        reads them row by row, decoding every column (10-18 ms per round for 400 rows,
        benchmarks/client_overhead.py). The same lengths, so the same batches."""
        data = self.train_dataset if train_dataset is None else train_dataset
        if not self.group_by_length or not isinstance(data, Dataset) or "input_ids" not in data.column_names:
            return super()._get_train_sampler(train_dataset)
        import pyarrow.compute as pc
        from transformers.trainer_pt_utils import LengthGroupedSampler

        lengths = pc.list_value_length(data.with_format("arrow")["input_ids"]).to_pylist()
        return LengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                    dataset=data, lengths=lengths)

    def floating_point_ops(self, inputs) -> int:
        """0: Trainer counts each step's FLOPs by walking every parameter (4-6 ms a step on SmolLM2), for a
        total hf_fedtask never reads."""
        return 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.objectives:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        for objective in self.objectives:
            loss = objective.loss(loss, outputs, inputs)
        return (loss, outputs) if return_outputs else loss


class LocalTrainer:
    """Runs local training on the host model. Each call is seeded on its own, so a client's result
    depends only on (state, data, seed) — the property that makes resumed runs bit-identical.

    The loop is a `transformers.Trainer` per call, or (`client_loop` lean, or auto where it applies) the
    `LeanLoop`, which takes the same optimizer steps without the Trainer's per-call setup.

    `args` is the run's recipe; inside `at_round(r, rounds)` every loop trains with round r's (`for_round`)."""

    def __init__(self, host: PeftHost, args: LocalTrainingArgs):
        self.host = host
        self.args = args
        self.current = args  # the recipe the loops train with: `args`, or a round's inside `at_round`
        self.collator = host.inputs.collator  # pads token ids, stacks pixel_values
        # a launcher's rank variables (even torchrun's for one process) would put each Trainer into a DDP
        # group with a distributed sampler; the federation owns the ranks (hf_fedtask.engine.ranks)
        hide_launch_from_trainers()
        self._scratch = tempfile.TemporaryDirectory(prefix="hf_fedtask_trainer_")
        unsupported = lean_unsupported(args.mixed_precision, args.optimizer)
        if args.client_loop == "lean" and unsupported:
            raise ConfigError(f"config: client_loop: lean: {unsupported}")
        self.lean = LeanLoop(self._training_args(seed=0), self.collator, self.host.inputs.group_by_length) if (
            args.client_loop != "trainer" and not unsupported) else None
        self.batched = BatchedLoop(self.lean) if self.lean is not None and args.batch_clients != "off" else None
        self._unbatchable: str | None = None  # why batching failed once (not retried)
        # Trainer.train() ends in accelerate's free_memory(), a full gc.collect() over every object of
        # the process on each client call (benchmarks/client_overhead.py times it). The host model,
        # input preparer and data live as long as the run, so move them out of the collector's scans once.
        gc.collect()
        gc.freeze()

    @contextmanager
    def at_round(self, round_: int, rounds: int) -> Iterator[LocalTrainer]:
        """Train with round `round_`'s recipe (`LocalTrainingArgs.for_round`: its learning rate) inside the block,
        on every loop (Trainer, lean, batched); the run's recipe again after it. The round comes from the server's
        instruction: under a round schedule one outside 1..rounds has no rate and is refused (ProtocolError)."""
        if self.args.lr_round_schedule != "constant" and not 1 <= round_ <= rounds:
            raise ProtocolError(f"round {round_} is outside this run's rounds 1..{rounds}: lr_round_schedule "
                                f"{self.args.lr_round_schedule} has no learning rate for it")
        self._use(self.args.for_round(round_, rounds))
        try:
            yield self
        finally:
            self._use(self.args)

    def _use(self, args: LocalTrainingArgs) -> None:
        if args == self.current:  # a constant schedule: nothing rebuilt, the loops exactly as before
            return
        self.current = args
        if self.lean is not None:  # the batched loop reads the lean loop's arguments
            self.lean.retarget(self._training_args(seed=0))

    @property
    def loop(self) -> str:
        """The loop this trainer runs: lean or trainer."""
        return "lean" if self.lean is not None else "trainer"

    @property
    def batches_clients(self) -> bool:
        """Whether `train_many` may train clients together."""
        return self.batched is not None and self._unbatchable is None

    def train_many(self, states: Sequence[TaskVector], datas: Sequence[Dataset], seeds: Sequence[int]
                   ) -> list[tuple[TaskVector, dict]] | None:
        """`train(states[k], datas[k], seed=seeds[k])` for every k, the clients trained together
        (`hf_fedtask.client.batched`) in groups that fit its memory budget; None where that does not apply
        (the caller then trains them one at a time). The first reason it does not is kept: later calls
        return None at once."""
        if not self.batches_clients or len(states) < 2:
            return None
        model = self.host.model
        self.host.load_state(states[0])  # sizes the head for the clients' (one) task
        param_name = {id(p): n for n, p in model.named_parameters()}
        names = {key: param_name[id(p)] for key, p in self.host.trainable_by_name().items()}  # saved -> module name
        if any(state.keys() != names.keys() for state in states):
            return None
        out = []
        size = self.batched.group_size(model)
        for first in range(0, len(states), size):
            starts = [{names[k]: v for k, v in state.items()} for state in states[first:first + size]]
            try:
                results = self.batched.fit_many(model, starts, datas[first:first + size], seeds[first:first + size],
                                                self.host.device)
            except NotBatchable as e:
                self._unbatchable = str(e)
                return None
            # the trained tensors under the saved names `state()` gives, without loading each into the model
            out += [(TaskVector({k: trained[n] for k, n in names.items()}), metrics) for trained, metrics in results]
        return out

    def train(self, state: TaskVector, data: Dataset, *, seed: int, objectives: Sequence[Objective] = (),
              linearize_at: TaskVector | None = None, linearization: str = "network") -> tuple[TaskVector, dict]:
        """Load `state`, train on tokenized `data`, return (trained state, metrics). `objectives`
        change the local loss (FedProx's proximal term, a SCAFFOLD correction, ...). With
        `linearize_at` (a state like `state`), the model trained is the first-order Taylor expansion
        around that point (`hf_fedtask.model.linearize`, mode `linearization`), started at `state`."""
        with self.host.loaded(state, linearize_at, linearization) as model:
            if self.lean is None:
                return self._fit(model, data, seed, objectives)
            for objective in objectives:  # as _ObjectiveTrainer.__init__ starts them
                objective.start(self.host.trainable_by_name())
            metrics = self.lean.fit(model, data, seed, objectives, self.host.device)
            return self.host.state(), metrics

    def _training_args(self, seed: int) -> _HostDeviceArguments:
        a = self.current
        device = self.host.device
        return _HostDeviceArguments(  # the one place hf_fedtask's setting names become transformers'
            output_dir=self._scratch.name,
            per_device_train_batch_size=a.batch_size,
            num_train_epochs=a.local_epochs,
            max_steps=a.local_steps,
            learning_rate=a.learning_rate,
            lr_scheduler_type=a.lr_scheduler,
            warmup_steps=a.warmup_steps,
            weight_decay=a.weight_decay,
            gradient_accumulation_steps=a.gradient_accumulation_steps,
            max_grad_norm=a.max_grad_norm,
            optim=a.optimizer,
            seed=seed,
            data_seed=seed,
            use_cpu=device.type == "cpu",
            host_device=None if device.type == "cpu" else str(device),
            bf16=a.mixed_precision == "bf16",
            fp16=a.mixed_precision == "fp16",
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            remove_unused_columns=False,
            **_length_grouping(self.host.inputs.group_by_length),
        )

    def _fit(self, model, data: Dataset, seed: int, objectives: Sequence[Objective]) -> tuple[TaskVector, dict]:
        trainer = _ObjectiveTrainer(
            model=model,
            args=self._training_args(seed),
            train_dataset=data,
            data_collator=self.collator,
            objectives=objectives,
            params=self.host.trainable_by_name() if objectives else None,
            group_by_length=self.host.inputs.group_by_length,
        )
        trainer.remove_callback(PrinterCallback)  # the simulator reports progress; no per-client prints
        lr_sum = _LearningRateSum()
        trainer.add_callback(lr_sum)
        out = trainer.train()
        metrics = {"train_loss": float(out.training_loss), "train_steps": int(out.global_step),
                   "train_samples": len(data), "lr_sum": lr_sum.total}
        return self.host.state(), metrics
