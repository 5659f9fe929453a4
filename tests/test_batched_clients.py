"""Clients trained together (`batch_clients: auto`, `hf_fedtask.client.batched`): a FedAvg run of the small MLP
equals the one-client-at-a-time run up to float rounding (and really went through the batched step); a model
with dropout falls back to one client at a time with a bit-identical result; each client's gradients are
clipped by its own norm, as `torch.nn.utils.clip_grad_norm_` clips one model's."""

from __future__ import annotations

import pytest
import torch
from conftest import make_config

from hf_fedtask.client import batched
from hf_fedtask.client.batched import _clip_per_client
from hf_fedtask.engine.inprocess import Federation

MLP = dict(tasks=["digits"], base_model="hf-fedtask/small-mlp", base_model_id=None, peft_method="full",
           batch_size=16, local_steps=-1, local_epochs=1.5, gradient_accumulation_steps=2, max_grad_norm=0.5,
           weight_decay=0.01, lr_scheduler="cosine", warmup_steps=1, num_clients=6)


def _rounds(config, rounds: int = 2):
    fed = Federation(config)
    state = fed.initial_state()
    fed.init = {k: v.clone() for k, v in state.vectors["shared"].items()}
    losses = []
    for r in range(1, rounds + 1):
        state, record = fed.run_round(state, r)
        losses.append(record["train_loss"])
    return fed, state, losses


def test_batched_clients_equal_one_at_a_time_up_to_float_rounding(tiny_bert_dir, tiny_tasks_dir, tmp_path,
                                                                  monkeypatch):
    calls = []
    fit_many = batched.BatchedLoop.fit_many
    monkeypatch.setattr(batched.BatchedLoop, "fit_many",
                        lambda self, model, starts, *a, **k: calls.append(len(starts)) or fit_many(
                            self, model, starts, *a, **k))
    _, one, one_losses = _rounds(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "a", batch_clients="off",
                                             **MLP))
    assert not calls
    fed, together, together_losses = _rounds(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "b",
                                                         batch_clients="auto", **MLP))
    assert fed.trainer.batches_clients and sum(calls) >= 2 * 4  # most of each round's clients, together
    for name, vector in one.vectors.items():
        for key, tensor in vector.items():
            torch.testing.assert_close(together.vectors[name][key], tensor, rtol=0, atol=1e-5, msg=key)
    assert together_losses == pytest.approx(one_losses, rel=1e-5)
    moved = sum(float((one.vectors["shared"][k] - fed.init[k]).abs().sum()) for k in one.vectors["shared"])
    assert moved > 1.0  # the comparison is between runs that trained


def test_a_model_with_dropout_falls_back_to_one_client_at_a_time(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    fed, auto, _ = _rounds(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "a", batch_clients="auto"), 1)
    assert not fed.trainer.batches_clients and fed.trainer._unbatchable  # text rows of their own lengths
    _, off, _ = _rounds(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "b", batch_clients="off"), 1)
    for name, vector in off.vectors.items():
        for key, tensor in vector.items():
            assert torch.equal(auto.vectors[name][key], tensor), key


def test_each_clients_gradients_are_clipped_by_their_own_norm():
    torch.manual_seed(0)
    grads = [torch.randn(3, 4, 5), torch.randn(3, 7)]  # 3 clients, two parameter tensors
    grads[0][1] *= 0.01  # client 1's norm stays under the threshold: unclipped
    stacked = [torch.zeros_like(g) for g in grads]
    for p, g in zip(stacked, grads):
        p.grad = g.clone()
    _clip_per_client(stacked, max_norm=1.0)
    for k in range(3):
        alone = [torch.zeros_like(g[k]) for g in grads]
        for p, g in zip(alone, grads):
            p.grad = g[k].clone()
        torch.nn.utils.clip_grad_norm_(alone, 1.0)
        for p, q in zip(stacked, alone):
            torch.testing.assert_close(p.grad[k], q.grad, rtol=1e-6, atol=1e-7)
