"""Empirical NTK features: φ(x) = ∇_θ f(x; θ)[output] over the trainable parameters of the host
model, one row per sample, restricted to a seeded subset of coordinates (TCT, Yu et al. 2022).

Instead of TCT's official code's one backward pass per sample (`per_sample_loop`, kept as the
reference for tests and `benchmarks/entk_bench.py`), the features of a batch come from one forward
and one backward pass:

- when every trainable parameter belongs to an `nn.Linear` or `nn.Conv2d` (LoRA, heads, a small
  CNN trained in full), each layer's input a and output gradient g are captured and only the
  selected coordinates are formed: ∂f/∂W[i, j] = Σ_t g[t, i]·a[t, j] (for a convolution, over the
  unfolded patches), the per-sample-gradient trick of Opacus and BackPACK, written by hand
  because it must never build the full per-sample gradients (n × P floats): a layer whose selected
  coordinates are dense enough (convolutions) gets its own per-sample gradient by one batched
  matmul, a few samples at a time, and the rest gather only the selected pairs;
- otherwise with `torch.func` (`vmap` over `grad` of a `functional_call`), which builds them.

Samples are independent in eval mode (no batch statistics), so the batched backward of Σ_i f(x_i)
gives every sample's own output gradients. Coordinates are the flat order of the trainable
parameters in PEFT's saved naming (`host.state()`). Batches go to the model's device; the features
come back as CPU float32 rows, whatever that device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from datasets import Dataset
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.model.device import model_device, to_device
from hf_fedtask.model.host import PeftHost


def coordinate_subset(total: int, p: int, seed: int) -> torch.Tensor:
    """The same `p` of `total` coordinates on every client and on the server: `randperm(total)[:p]`
    from a seeded generator, sorted (all of them when p ≥ total)."""
    if p >= total:
        return torch.arange(total)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=gen)[:p].sort().values


def _named(host: PeftHost, model: torch.nn.Module) -> list[tuple[str, str]]:
    """(module path, saved name) of each trainable parameter, in saved (coordinate) order."""
    saved = host.trainable_by_name()
    by_ptr = {p.data_ptr(): name for name, p in model.named_parameters() if p.requires_grad}
    order = host.state_keys()  # no copy of the parameters off the device
    return [(by_ptr[saved[k].data_ptr()], k) for k in order]


def input_batches(host: PeftHost, data: Dataset, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """The model inputs of `data` in order, collated by the host's collator, without labels."""
    loader = DataLoader(data, batch_size=batch_size, collate_fn=host.inputs.collator)
    for batch in loader:
        yield {k: v for k, v in batch.items() if k != "labels"}


def entk_features(host: PeftHost, state: TaskVector, data: Dataset, index: torch.Tensor, *, output: int = 0,
                  batch_size: int = 64) -> torch.Tensor:
    """(n, len(index)) float32: row i is ∇_θ f(x_i)[output] at `state` (shared modules + head, saved
    naming), at the coordinates `index` of the flat trainable parameters. The model is in eval mode."""
    with host.loaded(state) as model:
        paths = [path for path, _ in _named(host, model)]
        return model_features(model, paths, input_batches(host, data, batch_size), index, output=output)


def model_features(model: torch.nn.Module, paths: list[str], batches: Iterable[dict[str, torch.Tensor]],
                   index: torch.Tensor, *, output: int = 0) -> torch.Tensor:
    """The features of `batches` (model inputs) over the parameters at `paths` (module paths, in
    coordinate order), whatever their `requires_grad`; the model is put in eval mode meanwhile. Each
    batch is moved to the model's device and its rows come back to the CPU."""
    device = model_device(model)
    index = index.cpu()  # the coordinates' positions are found on the CPU,
    columns = index.to(device)  # the columns gathered where the gradients are
    was_training = model.training
    live = dict(model.named_parameters())
    flags = {path: live[path].requires_grad for path in live}
    model.eval()
    for path, p in live.items():
        p.requires_grad_(path in paths)
    offsets = torch.tensor([0, *[live[path].numel() for path in paths]]).cumsum(0)
    names = [(path, path) for path in paths]
    owners = _layer_owners(model, paths)
    rows = []
    try:
        for batch in batches:
            batch = to_device(batch, device)
            if owners is not None:
                rows.append(_layer_features(model, batch, owners, names, offsets, index, columns, output).cpu())
            else:
                rows.append(_vmap_features(model, batch, names, offsets, index, columns, output).cpu())
    finally:
        model.train(was_training)
        for path, p in live.items():
            p.requires_grad_(flags[path])
    return torch.cat(rows) if rows else torch.zeros(0, len(index))


def _layer_owners(model: torch.nn.Module, paths: list[str]) -> dict[str, tuple[torch.nn.Module, str]] | None:
    """parameter path -> (its nn.Linear / nn.Conv2d, "weight" | "bias"); None if any other kind."""
    modules = dict(model.named_modules())
    owners = {}
    for path in paths:
        parent, _, kind = path.rpartition(".")
        module = modules.get(parent)
        plain_conv = isinstance(module, torch.nn.Conv2d) and module.groups == 1 and module.padding_mode == "zeros"
        if not (isinstance(module, torch.nn.Linear) or plain_conv) or kind not in ("weight", "bias"):
            return None
        owners[path] = (module, kind)
    return owners


def _layer_features(model, batch, owners, names, offsets, index, columns, output,
                    budget: int = 1 << 22) -> torch.Tensor:
    """One forward and one backward pass; the selected coordinates formed from inputs and output grads.
    `index` (CPU) locates each parameter's coordinates, `columns` (the same, on the device) gathers them."""
    layers = {id(m): m for m, _ in owners.values()}
    inputs, outputs, calls = {}, {}, {}

    def capture(module, args, out):
        calls[id(module)] = calls.get(id(module), 0) + 1
        inputs[id(module)], outputs[id(module)] = args[0].detach(), out

    handles = [m.register_forward_hook(capture) for m in layers.values()]
    try:
        with torch.enable_grad():
            logits = model(**batch).logits
            used = [k for k in layers if k in outputs]
            if any(c > 1 for c in calls.values()):
                raise RuntimeError("a layer is called more than once per forward pass")
            grads = dict(zip(used, torch.autograd.grad(logits[:, output].sum(), [outputs[k] for k in used],
                                                       allow_unused=True)))
    finally:
        for h in handles:
            h.remove()
    n = logits.shape[0]
    out = torch.zeros(n, len(index), device=columns.device)
    for i, (path, _) in enumerate(names):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        start, stop = int(torch.searchsorted(index, lo)), int(torch.searchsorted(index, hi))
        module, kind = owners[path]
        if stop == start or grads.get(id(module)) is None:
            continue
        a, g = inputs[id(module)], grads[id(module)].detach()
        if isinstance(module, torch.nn.Conv2d):  # patches (n, C·kh·kw, L), output grads (n, O, L)
            a = F.unfold(a, module.kernel_size, module.dilation, module.padding, module.stride)
            g = g.reshape(n, g.shape[1], -1)
        else:  # any leading dims (tokens) become one: (n, T, in) and (n, T, out), summed over T
            a, g = a.reshape(n, -1, a.shape[-1]).transpose(1, 2), g.reshape(n, -1, g.shape[-1]).transpose(1, 2)
        if kind == "weight" and _dense_is_cheaper(stop - start, g.shape[1], a.shape[1], a.shape[-1]):
            sel = columns[start:stop] - lo  # per-sample weight gradients g·aᵀ by batched matmul, then the columns
            rows_per = max(1, budget // (g.shape[1] * a.shape[1]))  # temporaries of rows_per × O × in floats
            for r in range(0, n, rows_per):
                full = torch.bmm(g[r:r + rows_per], a[r:r + rows_per].transpose(1, 2))
                out[r:r + rows_per, start:stop] = full.reshape(full.shape[0], -1)[:, sel]
            continue
        chunk = max(1, budget // (n * a.shape[-1]))  # temporaries of n × chunk × L floats
        for s in range(start, stop, chunk):
            sel = columns[s:min(s + chunk, stop)] - lo
            if kind == "bias":
                out[:, s:s + len(sel)] = g[:, sel, :].sum(-1)
            else:
                width = a.shape[1]
                out[:, s:s + len(sel)] = (g[:, sel // width, :] * a[:, sel % width, :]).sum(-1)
    return out


def _dense_is_cheaper(selected: int, out_dim: int, in_dim: int, positions: int) -> bool:
    """Whether forming a layer's whole per-sample weight gradient (one batched matmul, O·in·L multiply-adds
    and O·in floats written per sample) beats gathering its `selected` coordinates (two gathers and a
    product of `selected`·L floats). The constants are CPU measurements (one thread): a gathered
    element costs about 300 matmul multiply-adds, a written output float about 100; so a convolution
    (L = 196-784) goes dense at 2 % of its coordinates and a linear layer on one position almost never."""
    return selected * positions * 300 > out_dim * in_dim * (positions + 100)


def _vmap_features(model, batch, names, offsets, index, columns, output) -> torch.Tensor:
    """The `torch.func` path. A padded text batch is split by length and fed without its attention mask
    (transformers' mask code branches on the mask's values, which `vmap` cannot trace): exact for
    right padding, which is what the tokenizers here produce."""
    mask = batch.get("attention_mask")
    if mask is None:
        return _gather(_vmap_gradients(model, batch, output), names, offsets, index, columns)
    lengths = mask.sum(1)
    out = torch.zeros(len(lengths), len(index), device=columns.device)
    for length in lengths.unique().tolist():
        rows = (lengths == length).nonzero().flatten()
        if not bool(mask[rows, :length].all()):
            raise ValueError("eNTK features: left-padded inputs are not supported")
        sub = {k: v[rows][:, :length] if v.dim() > 1 and v.shape[1] == mask.shape[1] else v[rows]
               for k, v in batch.items() if k != "attention_mask"}
        out[rows] = _gather(_vmap_gradients(model, sub, output), names, offsets, index, columns)
    return out


def _vmap_gradients(model, batch, output) -> dict[str, torch.Tensor]:
    """Every trainable parameter's per-sample gradients (n, *shape), by `torch.func`."""
    params = {path: p.detach() for path, p in model.named_parameters() if p.requires_grad}
    frozen = {path: p.detach() for path, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())
    keys = list(batch)

    def f(p, *single):
        inputs = {k: v.unsqueeze(0) for k, v in zip(keys, single)}
        return functional_call(model, ({**p, **frozen}, buffers), args=(), kwargs=inputs).logits[0, output]

    return vmap(grad(f), in_dims=(None, *[0] * len(keys)))(params, *[batch[k] for k in keys])


def _gather(grads: dict[str, torch.Tensor], names: list[tuple[str, str]], offsets: torch.Tensor,
            index: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The columns `index` of the per-sample gradients laid flat, without building the full flat rows
    (`columns`: `index` on the gradients' device)."""
    batch = next(iter(grads.values())).shape[0]
    out = torch.empty(batch, len(index), device=columns.device)
    for i, (path, _) in enumerate(names):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        start, stop = torch.searchsorted(index, lo), torch.searchsorted(index, hi)
        if stop > start:
            out[:, start:stop] = grads[path].reshape(batch, -1)[:, columns[start:stop] - lo].float()
    return out


def per_sample_loop(host: PeftHost, state: TaskVector, data: Dataset, index: torch.Tensor, *,
                    output: int = 0) -> torch.Tensor:
    """The same features by one backward pass per sample (TCT's official code): the reference."""
    with host.loaded(state) as model:
        device = model_device(model)
        columns = index.to(device)
        was_training = model.training
        model.eval()
        names = _named(host, model)
        live = dict(model.named_parameters())
        rows = []
        try:
            for batch in input_batches(host, data, 1):
                model.zero_grad(set_to_none=True)
                model(**to_device(batch, device)).logits[0, output].backward()
                flat = torch.cat([live[path].grad.reshape(-1) for path, _ in names])
                rows.append(flat[columns].float().cpu())
        finally:
            model.zero_grad(set_to_none=True)
            model.train(was_training)
    return torch.stack(rows) if rows else torch.zeros(0, len(index))
