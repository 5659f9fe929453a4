"""EMR-style unification (EMR-Merging: Huang et al., NeurIPS 2024, arXiv:2405.17461; as MaTU's clients
do it: Tsouvalas, Ozcelebi and Meratnia, 2025, arXiv:2502.06376, §3.2): one unified task vector for T
task vectors plus a binary mask and a scalar rescaler per task, from which each task's vector is
approximately recovered as λ_t·(m_t ⊙ τ).

    σ = sgn(Σ_t τ_t)                                   elected sign (0 where the sum is 0)
    μ[j] = max{|τ_t[j]| : sgn(τ_t[j]) = σ[j]}          largest agreeing magnitude
    τ = σ ⊙ μ
    m_t = 1[τ_t ⊙ τ > 0]
    λ_t = Σ|τ_t| / Σ|m_t ⊙ τ|                          ("global_sum", the paper's rescaler)
        or Σ_keys mean|τ_t[key]| / Σ_keys mean|m_t ⊙ τ[key]|   ("per_tensor_mean", EMR's code)

`unify` streams (see `streaming`): per chunk of all T tasks, one pass sums the tasks in order (the
sign), then x_t·σ gives both μ (its running max) and m_t (where it is > 0: the sign test of
τ_t ⊙ τ without the product, so no underflow), and the rescalers' sums are taken per key. Vectors
on an accelerator are unified there by the batched torch ops of `batched` (one stack of all tasks per
chunk; masks packed with torch instead of numpy) and τ and the masks stay there; CPU vectors take the
paths they always took.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hf_fedtask.core.names import RESCALERS
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge import batched, fused_passes, kernels
from hf_fedtask.merge.bitmask import pack_rows, packed_size, unpack_bits
from hf_fedtask.merge.streaming import Layout, chunk_len, gather, scatter
from hf_fedtask.merge.ties import check_compatible


@dataclass
class Unified:
    """τ, the masks and the rescalers. `masks[t]` is task t's mask bit-packed over the flat vector
    (`vector.flatten()` order: keys in order, each row-major), 1 bit per entry in numpy's
    `packbits` layout (see `bitmask`): a 1-D uint8 tensor of ⌈d/8⌉ bytes, the layout MaTU's wire
    form and the compact export use. `mask(t)` unpacks it."""

    vector: TaskVector
    masks: list[torch.Tensor]
    rescalers: list[float]

    def mask(self, t: int) -> TaskVector:
        """Task t's mask m_t as bool tensors shaped like the vector's."""
        flat = unpack_bits(self.masks[t], self.vector.numel())
        return TaskVector.unflatten(flat, {k: v.shape for k, v in self.vector.items()})

    def task_vector(self, t: int) -> TaskVector:
        """The approximation λ_t·(m_t ⊙ τ) of task t's vector."""
        mask = self.mask(t)
        return TaskVector({k: self.rescalers[t] * mask[k] * v for k, v in self.vector.items()})


@torch.no_grad()
def unify(vectors: Sequence[TaskVector], rescaler: str = "global_sum", backend: str = "auto") -> Unified:
    """Unify T task vectors into τ, T bit-packed masks and T rescalers. `backend`: "numba" (one fused
    pass, `fused_passes`; float32 CPU tensors), "batched" (a few torch ops over a stack of all tasks,
    `batched`: the path on an accelerator, where τ and the masks are returned), "torch" (the streaming
    reference) or "auto" (numba where it applies, batched on an accelerator, else torch): the same τ and
    masks bit for bit, rescalers within a few float32 ulps (their sums are accumulated in other orders)."""
    if rescaler not in RESCALERS:
        raise ValueError(f"rescaler must be one of {RESCALERS}, got {rescaler!r}")
    check_compatible(vectors, [1.0] * len(vectors))
    layout = Layout(vectors)
    path = kernels.choose(backend, layout)
    if path == "batched":
        unified, masks, sums = batched.unify(layout, vectors, per_key_sums=rescaler == "per_tensor_mean")
        return Unified(TaskVector(layout.unflatten(unified)), masks, _rescalers(sums, layout, rescaler))
    flats = [layout.flat_views(tv) for tv in vectors]
    unified = layout.empty_flat()
    device = layout.device
    masks = [torch.empty(packed_size(layout.numel), dtype=torch.uint8, device=device)  # both paths write every byte
             for _ in vectors]
    if path == "numba":
        sums = torch.from_numpy(fused_passes.unify_pass(kernels.Plan(layout, flats), unified, masks))
        return Unified(TaskVector(layout.unflatten(unified)), masks, _rescalers(sums, layout, rescaler))
    n_tasks, keys = len(vectors), list(layout.numels)
    key_index = {k: j for j, k in enumerate(keys)}
    on_cpu = device.type == "cpu"  # numpy packs the masks there; torch (`pack_rows`) on an accelerator
    mask_bytes = [m.numpy() for m in masks] if on_cpu else masks
    sums = torch.zeros(2, n_tasks, len(keys), dtype=torch.float64, device=device)  # Σ|τ_t| and Σ|m_t ⊙ τ| per key
    size = chunk_len(n_tasks, layout.dtype.itemsize, layout.numel, device)
    x_buf = torch.empty(n_tasks, size, dtype=layout.dtype, device=device)
    q_buf = torch.empty_like(x_buf)
    m_buf = torch.empty(n_tasks, size, dtype=torch.bool, device=device)
    sum_dtype = torch.promote_types(layout.dtype, torch.float32)
    for start, pieces in layout.chunks(size):
        n = pieces[-1].chunk_slice.stop
        x, q, m = gather(flats, pieces, x_buf[:, :n]), q_buf[:, :n], m_buf[:, :n]
        sign = x[0].clone()
        for row in x[1:]:
            sign += row  # in task order, as Σ_t τ_t is defined
        sign.sign_()
        torch.mul(x, sign, out=q)  # x_t·σ: > 0 exactly where τ_t agrees with the elected sign
        magnitude = q.amax(0).clamp_(min=0)
        scatter(sign.mul_(magnitude), pieces, unified)
        _positive(q, m)
        packed = np.packbits(m.numpy(), axis=1) if on_cpu else pack_rows(m)  # chunks start at multiples of 8 entries
        for dst, row in zip(mask_bytes, packed):
            dst[start // 8 : start // 8 + len(row)] = row
        torch.abs(x, out=x)
        torch.gt(q, 0, out=q).mul_(magnitude)  # |m_t ⊙ τ|
        for p in pieces:
            j = key_index[p.key]
            sums[0, :, j] += x[:, p.chunk_slice].sum(1, dtype=sum_dtype).double()
            sums[1, :, j] += q[:, p.chunk_slice].sum(1, dtype=sum_dtype).double()
    return Unified(TaskVector(layout.unflatten(unified)), masks, _rescalers(sums, layout, rescaler))


def _rescalers(sums: torch.Tensor, layout: Layout, rescaler: str) -> list[float]:
    """λ_t from the per-key sums [2, T, keys] (Σ|τ_t| and Σ|m_t ⊙ τ|; for "global_sum" any split of the
    keys into columns, e.g. one column of totals)."""
    sums = sums.cpu()
    if rescaler == "per_tensor_mean":  # each key's mean weighs the same (an empty key adds nothing)
        sums = sums / torch.tensor([max(n, 1) for n in layout.numels.values()], dtype=torch.float64)
    num, den = sums.sum(2)
    return [float(a / b) if b > 0 else 0.0 for a, b in zip(num.tolist(), den.tolist())]


def _positive(q: torch.Tensor, out: torch.Tensor) -> None:
    """out = q > 0 (bool). numpy writes bools faster than torch; it lacks bfloat16 and
    cannot reach an accelerator."""
    if q.dtype == torch.bfloat16 or q.device.type != "cpu":
        torch.gt(q, 0, out=out)
    else:
        np.greater(q.numpy(), 0, out=out.numpy())
