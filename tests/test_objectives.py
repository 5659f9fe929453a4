"""Pluggable local objectives: LinearCorrection adds its correction to every gradient; OneHotMSE replaces
the model's loss by the one-hot MSE (+ L2) formula."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_fedtask.client.objectives import LinearCorrection, OneHotMSE


def _tiny_module():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    params = {f"m.{k}": p for k, p in module.named_parameters()}
    return module, params


def test_linear_correction_adds_c_to_every_gradient():
    """After `start(params)`, ∇(loss) = ∇(model loss) + c for each corrected parameter, and exactly the
    model gradient for the others; a correction for an unknown parameter is a KeyError."""
    module, params = _tiny_module()
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    corrected = ["m.0.weight", "m.2.bias"]
    c = {k: torch.randn_like(params[k]) for k in corrected}
    objective = LinearCorrection(c)
    objective.start(params)
    model_loss = F.cross_entropy(module(x), y)
    plain = torch.autograd.grad(model_loss, list(params.values()), retain_graph=True)
    loss = objective.loss(model_loss, None, {"labels": y})
    grads = torch.autograd.grad(loss, list(params.values()))
    for (name, _), g, g0 in zip(params.items(), grads, plain):
        expected = g0 + c[name] if name in c else g0
        torch.testing.assert_close(g, expected, rtol=0, atol=1e-6, msg=name)
    assert not torch.allclose(grads[0], plain[0])  # the correction is not vanishingly small
    unknown = LinearCorrection({"m.9.weight": torch.zeros(1)})
    unknown.start(params)
    with pytest.raises(KeyError, match="m.9.weight"):
        unknown.loss(model_loss, None, {})


@pytest.mark.parametrize("as_mapping", [True, False], ids=["dict-outputs", "logits-attribute"])
def test_one_hot_mse_replaces_the_loss_by_the_hand_formula(as_mapping):
    """OneHotMSE: Σ_classes (logits − (onehot + offset))², batch mean, + (λ/2)·‖θ‖²; the model's loss is
    ignored; outputs may be a mapping or an object with `.logits`."""
    _, params = _tiny_module()
    logits = torch.tensor([[0.2, -1.0, 0.5], [1.5, 0.0, -0.3]])
    labels = torch.tensor([2, 0])
    outputs = {"logits": logits} if as_mapping else SimpleNamespace(logits=logits)
    l2, offset = 0.3, -1 / 3
    objective = OneHotMSE(l2=l2, offset=offset)
    objective.start(params)
    targets = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]) + offset
    mse = sum(float(((logits[i] - targets[i]) ** 2).sum()) for i in range(2)) / 2
    norm = sum(float((p.detach() ** 2).sum()) for p in params.values())
    for model_loss in (torch.tensor(0.0), torch.tensor(123.0)):
        got = objective.loss(model_loss, outputs, {"labels": labels})
        assert float(got.detach()) == pytest.approx(mse + l2 / 2 * norm, rel=1e-6)
    no_l2 = OneHotMSE(offset=offset)
    no_l2.start(params)
    assert float(no_l2.loss(torch.tensor(5.0), outputs, {"labels": labels})) == pytest.approx(mse, rel=1e-6)
