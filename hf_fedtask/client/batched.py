"""Clients trained together: K clients' copies of one small model stepped at once.

A small network's optimizer step is far from filling a CPU core or a GPU; K clients of a simulation then cost
K times a mostly fixed per-step overhead. `BatchedLoop` stacks the K clients' trainable parameters
([K, ...] per tensor), runs the forward and backward passes of all K in one `torch.func.vmap` over
`functional_call`, and steps one optimizer over the stacked tensors. Each client keeps its own data and batch
order (the lean loop's, from its own seed), its own optimizer state (AdamW and SGD update element by element,
so a stacked state is K independent states) and its own gradient clipping (a norm per client). The schedule
is shared, since the clients batched together take the same number of steps.

It applies where the result equals one client at a time up to float reduction order: no randomness in the
training step (vmap's `randomness="error"` refuses dropout, which would need each client's own random stream),
no local objective, no linearization, fixed-shape inputs, the same task and data size for every client of a
group, and no trainable convolution (vmap makes it a grouped convolution, slower on a CPU than one client at a
time). Full fine-tuning of small fully connected networks and LoRA on one frozen base both fit: the frozen
tensors are shared, not stacked. tests/test_batched_clients.py: the small MLP within 1e-5 of the lean loop.
With SGD the difference stays at rounding (2e-6 after a round of the small CNN, forced); AdamW's first,
normalized steps can magnify it on entries whose gradient is near zero, up to a few learning rates there.
Hand-written because no library trains several independent copies of a model in one vmapped step with
per-copy optimizer state and clipping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from datasets import Dataset

from hf_fedtask.client.lean import LeanLoop, PreparedData, _accepts_loss_kwargs, _training_loss, step_plan

MAX_STACKED_BYTES = 1 << 30
"""Bytes of stacked trainable parameters (×4: parameters, gradients and AdamW's two moments) a group of
clients may take; larger groups are split."""


class NotBatchable(Exception):
    """These clients cannot be trained together (the reason is the message); train them one at a time."""


class BatchedLoop:
    """`fit_many` trains several clients' copies of `model` together with the lean loop's arithmetic."""

    def __init__(self, lean: LeanLoop):
        self.lean = lean
        self._data, self._data_key = {}, None

    def group_size(self, model: torch.nn.Module) -> int:
        """How many clients fit in one group under MAX_STACKED_BYTES."""
        per_client = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) * 4
        return max(1, MAX_STACKED_BYTES // max(per_client, 1))

    def _stacked_data(self, prepared: Sequence[PreparedData]) -> dict[str, torch.Tensor]:
        """The group's prepared inputs concatenated ([K * n, ...]), kept for the next round of the same group."""
        key = tuple(id(p) for p in prepared)
        if self._data_key != key:
            self._data, self._data_key = _stacked(prepared), key
        return self._data

    def fit_many(self, model: torch.nn.Module, starts: Sequence[dict[str, torch.Tensor]], datas: Sequence[Dataset],
                 seeds: Sequence[int], device: torch.device) -> list[tuple[dict[str, torch.Tensor], dict]]:
        """Train K copies of `model`, copy k starting from `starts[k]` (every trainable parameter, by
        `named_parameters` name) on `datas[k]` with seed `seeds[k]`; returns each copy's trained parameters
        (by name, on the CPU) and its metrics. Raises NotBatchable before any change where it does not apply."""
        from torch.func import functional_call, grad_and_value, vmap
        from transformers import get_scheduler

        a, lean = self.lean.targs, self.lean
        if a.bf16 or a.fp16:
            raise NotBatchable("mixed precision")
        if any(isinstance(m, torch.nn.modules.conv._ConvNd) and any(p.requires_grad for p in m.parameters())
               for m in model.modules()):
            # vmap turns a batched convolution weight into a grouped convolution: on the small CNN, a round of
            # 10 clients took 8.7 s batched against 7.4 s one at a time (CPU, benchmarks/simulation_speed.py)
            raise NotBatchable("trainable convolutions (as grouped convolutions they are slower than one "
                               "client at a time)")
        prepared = [lean.prepared(d, device) for d in datas]
        if len({len(p) for p in prepared}) != 1:
            raise NotBatchable("clients of different data sizes take different numbers of steps")
        if any(p.tensors is None or p.sequence_keys for p in prepared):
            raise NotBatchable("inputs that are not fixed-shape tensors")
        k_clients, n = len(starts), len(prepared[0])
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        frozen = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
        frozen.update(dict(model.named_buffers()))
        stacked = {name: torch.stack([s[name].to(device) for s in starts]).contiguous() for name in names}

        bs, accumulation = a.per_device_train_batch_size, a.gradient_accumulation_steps
        steps_in_epoch, updates_per_epoch, max_steps, epochs = step_plan(a, n)
        # one fused kernel per step over the stacked tensors, where torch has one (AdamW, SGD): the unfused
        # update makes ~12 passes over K copies that no longer fit in a cache (3.7x slower at K=100 on the MLP)
        optimizer = lean.optimizer_for(model, {name: stacked[name] for name in names}, fused=True)
        scheduler = get_scheduler(a.lr_scheduler_type, optimizer=optimizer,
                                  num_warmup_steps=a.get_warmup_steps(max_steps), num_training_steps=max_steps)
        counts_items = _accepts_loss_kwargs(model)

        def loss_of(params, batch, num_items):
            inputs = batch if num_items is None else {**batch, "num_items_in_batch": num_items}
            out = functional_call(model, (params, frozen), args=(), kwargs=inputs)
            return out["loss"] if isinstance(out, dict) else out[0]

        step_fn = vmap(grad_and_value(loss_of), in_dims=(0, 0, 0 if counts_items else None), randomness="error")
        model.train()
        step_losses: list[torch.Tensor] = []  # [K] per batch
        data = self._stacked_data(prepared)  # every input as [K * n, ...]
        offsets = torch.arange(k_clients, device=device)[:, None] * n  # client k's rows start at k * n
        lr_sum, global_step = 0.0, 0
        remainder = steps_in_epoch % accumulation or accumulation
        generator_states = [torch.Generator() for _ in range(k_clients)]
        for epoch in range(epochs):
            orders = []
            for k, seed in enumerate(seeds):
                generator_states[k].manual_seed(seed + epoch)  # the lean loop's (accelerate's) order
                orders.append(torch.randperm(n, generator=generator_states[k]).tolist())
            for update in range(updates_per_epoch):
                size = accumulation if update != updates_per_epoch - 1 else remainder
                start = update * accumulation * bs
                grads_sum: dict[str, torch.Tensor] | None = None
                groups = [[orders[k][start + i * bs:start + (i + 1) * bs] for i in range(size)]
                          for k in range(k_clients)]
                indices = [torch.as_tensor([g[i] for g in groups], device=device) for i in range(size)]  # [K, B]
                batches = [{key: t.index_select(0, (index + offsets).flatten()).view(k_clients, -1, *t.shape[1:])
                            for key, t in data.items()} for index in indices]
                num_items = None
                if counts_items:
                    num_items = sum(b["labels"].ne(-100).flatten(1).sum(1) for b in batches)
                for batch in batches:
                    try:
                        grads, loss = step_fn(stacked, batch, num_items)
                    except RuntimeError as e:
                        if "randomness" in str(e) or "vmap" in str(e):
                            raise NotBatchable(f"the training step does not vectorize ({str(e).splitlines()[0]})") \
                                from None
                        raise
                    if not (counts_items and num_items is not None):
                        loss = loss / size
                        grads = {name: g / size for name, g in grads.items()}
                    grads_sum = grads if grads_sum is None else {name: grads_sum[name] + g for name, g in grads.items()}
                    step_losses.append(loss.detach())
                for name in names:
                    stacked[name].grad = grads_sum[name]
                if a.max_grad_norm > 0:
                    _clip_per_client([stacked[name] for name in names], a.max_grad_norm)
                optimizer.step()
                lr_sum += float(optimizer.param_groups[0]["lr"])
                scheduler.step()
                for name in names:
                    stacked[name].grad = None
                global_step += 1
                if global_step >= max_steps:
                    break
            if global_step >= max_steps:
                break
        out = []
        losses = torch.stack(step_losses).cpu() if step_losses else torch.zeros(0, k_clients)
        for k in range(k_clients):
            trained = {name: stacked[name][k].detach().cpu().clone() for name in names}
            out.append((trained, {"train_loss": _training_loss(list(losses[:, k]), global_step),
                                  "train_steps": global_step,
                                  "train_samples": n, "lr_sum": lr_sum}))
        return out


def _stacked(prepared: Sequence[PreparedData]) -> dict[str, torch.Tensor]:
    """Every input of the group's clients, one after the other: [K * n, ...] (client k's rows from k * n)."""
    return {key: torch.cat([p.tensors[key] for p in prepared]) for key in prepared[0].tensors}


def _clip_per_client(stacked: list[torch.Tensor], max_norm: float) -> None:
    """`torch.nn.utils.clip_grad_norm_` for each client's slice of the stacked gradients: the 2-norm of the
    per-tensor norms, and the gradients scaled by min(1, max_norm / (norm + 1e-6))."""
    norms = torch.stack([p.grad.flatten(1).norm(dim=1) for p in stacked]).norm(dim=0)  # [K]
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for p in stacked:
        p.grad.mul_(scale.view(-1, *([1] * (p.grad.dim() - 1))))

