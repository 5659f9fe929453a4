"""The lean local-training loop: the optimizer steps a `transformers.Trainer` run takes, without the Trainer.

A simulated federation trains many clients for a few steps each. Through `Trainer.train` every (client, task)
pays for TrainingArguments, an Accelerator, a DataLoader that reads Arrow rows and collates each batch, callbacks
and a full `gc.collect()` (benchmarks/simulation_speed.py attributes the time). `LeanLoop` keeps what decides the
numbers and drops the rest:

* the same seeding (`set_seed(seed)` as `Trainer.__init__`), the same batch order (accelerate's
  `SeedableRandomSampler`: a `torch.randperm` from a generator seeded `data_seed + epoch`, or transformers'
  `LengthGroupedSampler` on the global generator), and the one draw of the global generator each epoch's
  DataLoader iterator makes, so dropout sees the same random stream;
* the same optimizer (`Trainer.get_optimizer_cls_and_kwargs`, weight decay on `get_decay_parameter_names`),
  schedule (`get_scheduler`, `TrainingArguments.get_warmup_steps`), gradient accumulation with the Trainer's
  loss scaling and `num_items_in_batch`, clipping (`clip_grad_norm_` at `max_grad_norm`), bf16 autocast with
  fp32 outputs (accelerate's `prepare_model`), and its training loss (mean of the steps' losses);
* data prepared once (`PreparedData`): every row collated once into tensors (on the model's device where they
  fit) and batched by index, cut to the batch's longest row as per-batch dynamic padding would.

Results equal the Trainer's bit for bit on CPU (tests/test_lean_loop.py). What it does not do is refused by
`lean_unsupported` (fp16's gradient scaler, optimizers other than RunConfig's), and `LocalTrainer` then uses the
Trainer. Hand-written because transformers has no reusable step loop: `Trainer.train` rebuilds its state per call.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from datasets import Dataset

LEAN_OPTIMIZERS = ("adamw_torch", "sgd")


def lean_unsupported(mixed_precision: str, optimizer: str) -> str | None:
    """Why the lean loop cannot reproduce the Trainer for these settings (None when it can)."""
    if mixed_precision == "fp16":
        return "fp16 needs the Trainer's gradient scaler"
    if optimizer not in LEAN_OPTIMIZERS:
        return f"optimizer {optimizer!r} is not one the lean loop reproduces ({', '.join(LEAN_OPTIMIZERS)})"
    return None


class PreparedData:
    """A dataset's rows collated once into tensors, batched by index.

    `batch(indices)` equals `collator([data[i] for i in indices])`: fixed-shape inputs are indexed, padded
    sequences are indexed and cut to the batch's longest row (on the padding side). The equality is checked on
    a few batches when prepared; where it does not hold (a collator that does more than pad and stack), batches
    are collated from the cached rows instead, which still skips the per-step Arrow reads."""

    def __init__(self, data: Dataset, collator: Callable, device: torch.device, budget_bytes: int):
        columns = data[:]  # one Arrow read of every column
        self.rows = [{k: columns[k][i] for k in columns} for i in range(len(data))]
        self.lengths = [len(r["input_ids"]) for r in self.rows] if "input_ids" in columns else None
        self.collator = collator
        self.tensors: dict[str, torch.Tensor] | None = None
        self.sequence_keys: tuple[str, ...] = ()
        self.left_padded = False
        full = collator(self.rows) if self.rows else {}
        if full and all(torch.is_tensor(v) and v.dim() >= 1 and len(v) == len(self.rows) for v in full.values()):
            self.tensors = dict(full)
            if self.lengths:
                longest = max(self.lengths)
                self.sequence_keys = tuple(k for k, v in full.items() if v.dim() >= 2 and v.shape[1] == longest)
                self.left_padded = self._left_padded(full)
            if not self._agrees():
                self.tensors = None
        if self.tensors is not None and device.type != "cpu" and self.nbytes <= budget_bytes:
            self.tensors = {k: v.to(device) for k, v in self.tensors.items()}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in (self.tensors or {}).values())

    def batch(self, indices: Sequence[int]) -> dict:
        if self.tensors is None:
            return self.collator([self.rows[i] for i in indices])
        index = torch.as_tensor(indices, device=next(iter(self.tensors.values())).device)
        batch = {k: v.index_select(0, index) for k, v in self.tensors.items()}
        if self.sequence_keys:
            longest = max(self.lengths[i] for i in indices)
            for k in self.sequence_keys:
                batch[k] = batch[k][:, -longest:] if self.left_padded else batch[k][:, :longest]
        return batch

    def _left_padded(self, full: dict) -> bool:
        mask = full.get("attention_mask")
        return mask is not None and mask.dim() == 2 and bool((mask[:, -1] == 1).all()) and not bool(
            (mask[:, 0] == 1).all())

    def _agrees(self) -> bool:
        """The indexed batches equal the collator's on the first rows, the shortest and the longest."""
        n = len(self.rows)
        probes = [list(range(min(n, 4)))]
        if self.lengths is not None:
            order = sorted(range(n), key=self.lengths.__getitem__)
            probes += [order[:3], order[-3:][::-1]]
        for indices in probes:
            fast, reference = self.batch(indices), self.collator([self.rows[i] for i in indices])
            if fast.keys() != reference.keys():
                return False
            for k, v in reference.items():
                if not (torch.is_tensor(v) and v.dtype == fast[k].dtype and v.shape == fast[k].shape
                        and torch.equal(v, fast[k])):
                    return False
        return True


class LeanLoop:
    """Local training with the Trainer's arithmetic. `training_args` is the `TrainingArguments` a Trainer
    would get, built once (each `fit` takes its own seed) and replaced by `retarget` when a round's recipe
    differs; `fit`'s objectives change the loss as `_ObjectiveTrainer.compute_loss` does on the Trainer path."""

    def __init__(self, training_args, collator: Callable, group_by_length: bool,
                 data_budget_bytes: int = 2 << 30):
        self.collator = collator
        self.group_by_length = group_by_length
        self.budget = data_budget_bytes
        self.retarget(training_args)
        self._prepared: OrderedDict[tuple, PreparedData] = OrderedDict()
        self._decay_names: dict[int, set[str]] = {}

    def retarget(self, training_args) -> None:
        """Train with other `TrainingArguments` from now on (a round's learning rate: `LocalTrainer.at_round`);
        the prepared data are kept."""
        from transformers import Trainer

        self.targs = training_args
        self.optimizer_cls, self.optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args)

    # -- data -------------------------------------------------------------------------------------------
    def prepared(self, data: Dataset, device: torch.device) -> PreparedData:
        """`data` prepared once per content (the datasets fingerprint) and device; least recently used
        preparations are dropped beyond the byte budget."""
        key = (getattr(data, "_fingerprint", None) or id(data), len(data), str(device))
        if key in self._prepared:
            self._prepared.move_to_end(key)
            return self._prepared[key]
        prepared = PreparedData(data, self.collator, device, self.budget)
        self._prepared[key] = prepared
        while len(self._prepared) > 1 and sum(p.nbytes for p in self._prepared.values()) > self.budget:
            self._prepared.popitem(last=False)
        return prepared

    def _epoch_order(self, data: PreparedData, epoch: int, seed: int) -> list[int]:
        """The indices in the order the Trainer's DataLoader yields them in `epoch`."""
        # the DataLoader iterator's base seed: one draw of the global generator per epoch
        torch.empty((), dtype=torch.int64).random_()
        n = len(data)
        if self.group_by_length and data.lengths is not None:
            from transformers.trainer_pt_utils import get_length_grouped_indices

            size = self.targs.train_batch_size * self.targs.gradient_accumulation_steps
            return get_length_grouped_indices(data.lengths, size, generator=None)
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)  # accelerate's SeedableRandomSampler
        return torch.randperm(n, generator=generator).tolist()

    # -- optimizer --------------------------------------------------------------------------------------
    def optimizer_for(self, model: torch.nn.Module, params: dict[str, torch.Tensor] | None = None,
                      fused: bool = False) -> torch.optim.Optimizer:
        """The Trainer's optimizer over `model`'s trainable parameters (or over `params`, tensors standing for
        them by `named_parameters` name), weight decay on the Trainer's decay names; `fused`: torch's fused
        kernel of the same update (the same arithmetic, rounded differently)."""
        from transformers import Trainer

        decay = self._decay_names.get(id(model))
        if decay is None:
            decay = self._decay_names[id(model)] = set(Trainer.get_decay_parameter_names(None, model))
        named = list(params.items()) if params is not None else [
            (n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.targs.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return self.optimizer_cls(groups, **self.optimizer_kwargs, **({"fused": True} if fused else {}))

    # -- the loop ---------------------------------------------------------------------------------------
    def fit(self, model: torch.nn.Module, data: Dataset, seed: int, objectives: Sequence, device: torch.device) -> dict:
        """Train `model` in place on `data` (objectives already started); returns the metrics `Trainer.train`
        gives `LocalTrainer`."""
        from transformers import get_scheduler, set_seed

        a = self.targs
        set_seed(seed)  # Trainer.__init__
        prepared = self.prepared(data, device)
        bs, accumulation = a.per_device_train_batch_size, a.gradient_accumulation_steps
        steps_in_epoch, updates_per_epoch, max_steps, epochs = step_plan(a, len(prepared))
        optimizer = self.optimizer_for(model)
        scheduler = get_scheduler(a.lr_scheduler_type, optimizer=optimizer,
                                  num_warmup_steps=a.get_warmup_steps(max_steps), num_training_steps=max_steps)
        clipped = [p for p in model.parameters() if p.requires_grad]
        counts_items = _accepts_loss_kwargs(model)
        shifts = _loss_shifts_labels(model)
        forward = _forward(model, device, bf16=a.bf16)
        model.train()  # the Trainer sets it before every step; nothing in a step changes it
        _zero_grad(clipped)
        losses: list[torch.Tensor] = []
        lr_sum, global_step = 0.0, 0
        remainder = steps_in_epoch % accumulation or accumulation
        for epoch in range(epochs):
            order = self._epoch_order(prepared, epoch, seed)  # the Trainer path's data_seed is the call's seed
            batches = [order[i:i + bs] for i in range(0, len(order), bs)]
            for update in range(updates_per_epoch):
                group = batches[update * accumulation:update * accumulation + (
                    accumulation if update != updates_per_epoch - 1 else remainder)]
                inputs = [_to_device(prepared.batch(b), device) for b in group]
                num_items = None
                if counts_items and "labels" in inputs[0]:
                    num_items = sum((b["labels"][..., 1:] if shifts else b["labels"]).ne(-100).sum() for b in inputs)
                for batch in inputs:
                    outputs = forward(batch, num_items if counts_items else None)
                    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
                    for objective in objectives:
                        loss = objective.loss(loss, outputs, batch)
                    if not (counts_items and num_items is not None):
                        loss = loss / len(group)
                    loss.backward()
                    losses.append(loss.detach())
                if a.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(clipped, a.max_grad_norm)
                optimizer.step()
                lr_sum += float(optimizer.param_groups[0]["lr"])
                scheduler.step()
                _zero_grad(clipped)
                global_step += 1
                if global_step >= max_steps:
                    break
            if global_step >= max_steps:
                break
        return {"train_loss": _training_loss(losses, global_step), "train_steps": global_step,
                "train_samples": len(prepared), "lr_sum": lr_sum}


def step_plan(targs, n: int) -> tuple[int, int, int, int]:
    """(batches per epoch, optimizer steps per epoch, optimizer steps in all, epochs) of `n` rows, as
    `Trainer.set_initial_training_values` counts them."""
    steps_in_epoch = math.ceil(n / targs.per_device_train_batch_size)
    accumulation = targs.gradient_accumulation_steps
    updates_per_epoch = max(steps_in_epoch // accumulation + int(steps_in_epoch % accumulation > 0), 1)
    if targs.max_steps > 0:
        max_steps = targs.max_steps
        return steps_in_epoch, updates_per_epoch, max_steps, (
            max_steps // updates_per_epoch + int(max_steps % updates_per_epoch > 0))
    return (steps_in_epoch, updates_per_epoch, math.ceil(targs.num_train_epochs * updates_per_epoch),
            math.ceil(targs.num_train_epochs))


def _training_loss(losses: list[torch.Tensor], steps: int) -> float:
    """The Trainer's reported loss: the sum of the steps' (scaled) losses over the optimizer steps, a NaN or inf
    step replaced by the running mean so far (`logging_nan_inf_filter`, with no logging in between)."""
    total = torch.tensor(0.0)
    for loss in losses:
        loss = loss.float().cpu()
        total = total + (total / (1 + steps) if torch.isnan(loss) or torch.isinf(loss) else loss)
    return total.item() / max(steps, 0.001)


def _zero_grad(params: list[torch.nn.Parameter]) -> None:
    """`model.zero_grad()` (set to None) over the trainable parameters, the only ones holding gradients,
    without walking every module and frozen parameter."""
    for p in params:
        p.grad = None


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) and v.device != device else v for k, v in batch.items()}


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    from transformers.trainer import unwrap_peft_model

    return unwrap_peft_model(model)


def _accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Trainer.__init__'s test: whether the model takes `num_items_in_batch` (and scales the loss itself)."""
    import inspect

    inner = _unwrapped(model)
    if hasattr(inner, "accepts_loss_kwargs"):
        return bool(inner.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(inner.forward).parameters.values())


def _loss_shifts_labels(model: torch.nn.Module) -> bool:
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    inner = _unwrapped(model)
    return LOSS_MAPPING.get(getattr(inner, "loss_type", None)) is ForCausalLMLoss and not getattr(
        getattr(inner, "config", None), "is_encoder_decoder", False)


def _forward(model: torch.nn.Module, device: torch.device, bf16: bool) -> Callable:
    """The Trainer's forward call: `num_items_in_batch` passed where the model takes it; under bf16, autocast
    around the forward pass and its outputs back in fp32, as accelerate's `prepare_model` wraps `model.forward`
    (`convert_outputs_to_fp32`), so a loss objective computes in fp32 on either path."""
    from accelerate.utils import convert_to_fp32

    def forward(batch: dict, num_items):
        inputs = batch if num_items is None else {**batch, "num_items_in_batch": num_items}
        if not bf16:
            return model(**inputs)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            outputs = model(**inputs)
        return convert_to_fp32(outputs)

    return forward
