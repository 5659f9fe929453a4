"""Pluggable local objectives: terms a strategy adds to (or puts in place of) the model's own loss
during local training, instead of a growing keyword list on the trainer.

An objective sees the parameters being trained by their PEFT saved names (`params`, taken when
local training starts) and returns the loss to minimize from the model's loss, outputs and inputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F


class Objective:
    """Identity objective; subclasses override `start` (anchors) and `loss`."""

    def start(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        """Called once when local training starts, with the trainable parameters by saved name."""
        self.params = dict(params)

    def loss(self, model_loss: torch.Tensor, outputs, inputs: Mapping) -> torch.Tensor:
        return model_loss


class _Placed(dict):
    """Fixed tensors by saved name (CPU tensors from the server), each moved to a parameter's device and
    dtype once, on first use."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        super().__init__(tensors)
        self._moved: dict[str, torch.Tensor] = {}

    def like(self, key: str, p: torch.Tensor) -> torch.Tensor:
        t = self._moved.get(key)
        if t is None or t.device != p.device or t.dtype != p.dtype:
            t = self._moved[key] = self[key].to(device=p.device, dtype=p.dtype)
        return t


class ProximalTerm(Objective):
    """FedProx (Li et al., 2020): + (μ/2)·‖θ − θ_start‖² over the trainable parameters."""

    def __init__(self, mu: float):
        self.mu = mu

    def start(self, params):
        super().start(params)
        self.anchor = {k: p.detach().clone() for k, p in self.params.items()}

    def loss(self, model_loss, outputs, inputs):
        if self.mu == 0:
            return model_loss
        prox = sum(((p - self.anchor[k]) ** 2).sum() for k, p in self.params.items())
        return model_loss + (self.mu / 2) * prox


class AnchoredRidge(Objective):
    """+ (λ/2)·‖θ − θ₀‖² with a fixed anchor θ₀ by saved name (kernel ridge regression when θ is the
    weight of a model linearized at θ₀: F²L²'s strongly convex objective). Unlike `ProximalTerm`,
    whose anchor is where each round's local training starts, θ₀ stays put for the whole run."""

    def __init__(self, lam: float, anchor: Mapping[str, torch.Tensor]):
        self.lam, self.anchor = lam, _Placed(anchor)

    def loss(self, model_loss, outputs, inputs):
        if self.lam == 0:
            return model_loss
        missing = [k for k in self.params if k not in self.anchor]
        if missing:
            raise KeyError(f"ridge anchor lacks parameter {missing[0]!r}")
        ridge = sum(((p - self.anchor.like(k, p)) ** 2).sum() for k, p in self.params.items())
        return model_loss + (self.lam / 2) * ridge


class LinearCorrection(Objective):
    """+ ⟨c, θ⟩ with a fixed vector c by saved name: its gradient adds c to every step, which is
    SCAFFOLD's correction c − c_i (Karimireddy et al., 2020) when c = c_server − c_client."""

    def __init__(self, correction: Mapping[str, torch.Tensor]):
        self.correction = _Placed(correction)

    def loss(self, model_loss, outputs, inputs):
        missing = [k for k in self.correction if k not in self.params]
        if missing:
            raise KeyError(f"correction for unknown parameter {missing[0]!r}")
        return model_loss + sum((self.correction.like(k, p) * p).sum() for k, p in self.params.items()
                                if k in self.correction)


class OneHotMSE(Objective):
    """Replaces the model's loss by the mean squared error of the logits against one-hot targets
    (shifted by `offset`, e.g. −1/C as in TCT), summed over classes and averaged over the batch,
    plus (λ/2)·‖θ‖² over the trainable parameters (F²L², TCT's linear stage)."""

    def __init__(self, l2: float = 0.0, offset: float = 0.0):
        self.l2, self.offset = l2, offset

    def loss(self, model_loss, outputs, inputs):
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs.logits
        target = F.one_hot(inputs["labels"], logits.shape[-1]).to(logits.dtype) + self.offset
        mse = ((logits - target) ** 2).sum(-1).mean()
        if self.l2:
            mse = mse + (self.l2 / 2) * sum((p ** 2).sum() for p in self.params.values())
        return mse


class GradientAscent(Objective):
    """The negative of another objective's loss: stochastic gradient ascent on a client's data, the
    unlearning baseline (SGA) the F²L² paper compares against."""

    def __init__(self, inner: Objective):
        self.inner = inner

    def start(self, params):
        super().start(params)
        self.inner.start(params)

    def loss(self, model_loss, outputs, inputs):
        return -self.inner.loss(model_loss, outputs, inputs)
