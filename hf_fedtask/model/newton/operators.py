"""The Hessian F²L²'s removal step needs, as operators over `TaskVector`s: a model linearized around w₀
(`hf_fedtask.model.linearize`, whole network) trained on the squared error against one-hot targets, summed
over classes and averaged over samples (`OneHotMSE`):

    D(w)  = (1/n)·Σ_x ‖f_lin(x; w) − onehot(y)‖²          data term
    ∇D(w) = (2/n)·Σ_x J(x)ᵀ(f_lin(x; w) − onehot(y))     `data_gradient`
    H·v   = (2/n)·Σ_x J(x)ᵀJ(x)·v                        `gauss_newton_product` (exact: D is quadratic)

H·v costs one forward pass with a jvp (J·v) and one backward pass (Jᵀ·), never the P × P matrix
(`GaussNewton`); where the Jacobian itself, n·C × P floats (C outputs), is small enough it is formed once from
the per-sample output gradients (`hf_fedtask.model.entk`) and every product is two matrix products
(`JacobianGaussNewton`); `hessian` picks. `objective_minimizer` is where training that reached its optimum
ends. Batches go to the host model's device; the vectors returned are CPU tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from datasets import Dataset
from torch.utils.data import DataLoader

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.model.device import model_device, to_cpu, to_device
from hf_fedtask.model.host import PeftHost
from hf_fedtask.model.newton.solvers import SolveInfo, conjugate_gradient


def _batches(host: PeftHost, data: Dataset, batch_size: int):
    for batch in DataLoader(data, batch_size=batch_size, collate_fn=host.inputs.collator):
        labels = batch.pop("labels")
        yield batch, labels


def _gradients(host: PeftHost) -> TaskVector:
    """The trainable parameters' gradients by saved name, as CPU tensors."""
    params = host.trainable_by_name()
    return TaskVector({k: to_cpu(p.grad) if p.grad is not None else torch.zeros_like(p, device="cpu")
                       for k, p in params.items()})


def data_gradient(host: PeftHost, state: TaskVector, point: TaskVector, data: Dataset,
                  batch_size: int = 128) -> tuple[TaskVector, float]:
    """(∇D(w), D(w)) at w = `state` for the model linearized at `point`, over prepared `data` (eval mode)."""
    n = len(data)
    with host.loaded(state, point) as model:
        model.eval()
        model.zero_grad(set_to_none=True)
        device = model_device(model)
        total = 0.0
        with torch.enable_grad():
            for inputs, labels in _batches(host, data, batch_size):
                inputs, labels = to_device(inputs, device), labels.to(device)
                logits = model(**inputs).logits
                loss = ((logits - F.one_hot(labels, logits.shape[-1]).to(logits.dtype)) ** 2).sum() / n
                loss.backward()
                total += float(loss.detach())
        grads = _gradients(host)
        model.zero_grad(set_to_none=True)
    return grads, total


class GaussNewton:
    """v ↦ H·v over prepared `data`, H the Hessian of D (independent of w for the linearized model).
    Used as a context manager: the model is linearized at `point` and the data collated once, and
    each product only moves the live parameters to point + v (the batches are moved to the model's
    device once, on entering)."""

    def __init__(self, host: PeftHost, point: TaskVector, data: Dataset, batch_size: int = 512):
        self.host, self.point, self.n = host, point, len(data)
        self.batches = [inputs for inputs, _ in _batches(host, data, batch_size)]

    def __enter__(self) -> GaussNewton:
        self._context = self.host.loaded(self.point, self.point)
        self.model = self._context.__enter__()
        self.model.eval()
        self.params = self.host.trainable_by_name()
        device = model_device(self.model)
        self.batches = [to_device(inputs, device) for inputs in self.batches]
        return self

    def __exit__(self, *exc) -> None:
        self.model.zero_grad(set_to_none=True)
        self._context.__exit__(*exc)

    def __call__(self, v: TaskVector) -> TaskVector:
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(self.point[k] + v[k])
        self.model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            for inputs in self.batches:
                jv = self.model.tangent_logits(inputs)  # J·v, since the model sits at point + v
                ((jv ** 2).sum() / self.n).backward()  # gradient (2/n)·Jᵀ(J·v)
        return _gradients(self.host)


JACOBIAN_BYTES = 512 << 20  # the largest Jacobian `hessian` forms (float32): LoRA on MiniLM over 320 texts is ~190 MB


class JacobianGaussNewton:
    """v ↦ H·v = (2/n)·Jᵀ(J·v) with J (n·C × P, float32, on the CPU) formed on entering from the model's
    per-sample output gradients at `point` (`hf_fedtask.model.entk`: one forward and C backward passes
    per batch); the same operator as `GaussNewton` (J is the linearized model's Jacobian at its point),
    for `outputs` = C classes. Vectors map to J's columns in the host's saved-name order."""

    def __init__(self, host: PeftHost, point: TaskVector, data: Dataset, outputs: int):
        self.host, self.point, self.data, self.outputs, self.n = host, point, data, outputs, len(data)

    def __enter__(self) -> JacobianGaussNewton:
        from hf_fedtask.model.entk import entk_features

        self.keys = self.host.state_keys()  # J's column order
        self.shapes = {k: self.point[k].shape for k in self.keys}
        index = torch.arange(sum(math.prod(shape) for shape in self.shapes.values()))
        self.jacobian = torch.cat([entk_features(self.host, self.point, self.data, index, output=c)
                                   for c in range(self.outputs)])
        return self

    def __exit__(self, *exc) -> None:
        self.jacobian = None

    def __call__(self, v: TaskVector) -> TaskVector:
        flat = TaskVector({k: v[k] for k in self.keys}).flatten().float()
        return TaskVector.unflatten(self.jacobian.T @ (self.jacobian @ flat) * (2.0 / self.n), self.shapes)


def hessian(host: PeftHost, point: TaskVector, data: Dataset, batch_size: int = 512,
            max_bytes: int = JACOBIAN_BYTES) -> GaussNewton | JacobianGaussNewton:
    """The Gauss-Newton operator of `data` at `point`, as a context manager: with the Jacobian formed
    (`JacobianGaussNewton`) when it pays and fits, else matrix-free (`GaussNewton`). It pays when the C·P
    trainable outputs' derivatives are at most half the model's parameter count N: a product through J
    costs 2·C·P multiply-adds per sample, a matrix-free one at least a forward pass, ≥ N (a probe or LoRA on
    a frozen encoder: C·P ≪ N; a model trained in full: C·P = C·N, and the jvp is cheaper). It fits when its
    n·C·P float32 are at most `max_bytes`. C is read from one forward pass of the model at `point`."""
    trainable = sum(t.numel() for t in point.values())
    with host.loaded(point) as model:
        model.eval()
        first = next(_batches(host, data.select(range(min(1, len(data)))), 1))[0]
        with torch.no_grad():
            outputs = model(**to_device(first, model_device(model))).logits.shape[-1]
        parameters = sum(p.numel() for p in model.parameters())
    if 2 * outputs * trainable <= parameters and len(data) * outputs * trainable * 4 <= max_bytes:
        return JacobianGaussNewton(host, point, data, outputs)
    return GaussNewton(host, point, data, batch_size)


def gauss_newton_product(host: PeftHost, point: TaskVector, v: TaskVector, data: Dataset,
                         batch_size: int = 512) -> TaskVector:
    """H·v once (`GaussNewton` for many products)."""
    with GaussNewton(host, point, data, batch_size) as product:
        return product(v)


def objective_minimizer(host: PeftHost, point: TaskVector, data: Dataset, *, l2: float = 0.0, ridge: float = 0.0,
                        batch_size: int = 512, iterations: int = 5000, tolerance: float = 1e-7,
                        max_bytes: int = JACOBIAN_BYTES) -> tuple[TaskVector, SolveInfo]:
    """(w, how CG went) for w = argmin D(w) + (l2/2)·‖w‖² + (ridge/2)·‖w − w₀‖² over prepared `data`, the model
    linearized at w₀ = `point`: one exact Newton step from w₀, (H + (l2 + ridge)·I)·s = ∇D(w₀) + l2·w₀, since
    the objective is quadratic. Where training reaches it, retraining ends there in any order: the point F²L²'s
    certificate compares a removal with (`benchmarks/f2l2_at_optimum.py`). l2 + ridge must be > 0: H is
    singular where the data span fewer directions than the model has, and the minimizer is not unique.
    `max_bytes`: the largest Jacobian formed for the products (`hessian`)."""
    damping = l2 + ridge
    if not damping > 0:
        raise ValueError(f"objective_minimizer needs l2 + ridge > 0, got l2={l2:g}, ridge={ridge:g}")
    gradient, _ = data_gradient(host, point, point, data)
    with hessian(host, point, data, batch_size, max_bytes) as products:
        step, info = conjugate_gradient(products, gradient + point * l2 if l2 else gradient, damping=damping,
                                        iterations=iterations, tolerance=tolerance)
    return point - step, info
