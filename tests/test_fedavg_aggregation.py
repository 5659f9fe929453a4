"""FedAvg/FedProx server math against hand computation, and the proximal loss term."""

import pytest
import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError
from hf_fedtask.strategies import FedAvg, FedProx, GlobalState, build_strategy, head_name


def _tv(**tensors):
    return TaskVector({k: torch.tensor(v, dtype=torch.float32) for k, v in tensors.items()})


def _state():
    return GlobalState(
        round=3,
        vectors={
            "shared": _tv(a=[1.0, 2.0], b=[[0.5]]),
            head_name("x"): _tv(w=[0.0, 0.0]),
            head_name("y"): _tv(w=[1.0, 1.0]),
        },
    )


def _updates():
    # client 0 holds x (10 samples); client 1 holds x (30) and y (20); client 2 holds y (40)
    return [
        ClientUpdate(0, 4, {"shared": _tv(a=[1.0, 0.0], b=[[1.0]]), head_name("x"): _tv(w=[1.0, 2.0])}, {"x": 10}),
        ClientUpdate(1, 4, {"shared": _tv(a=[0.0, 1.0], b=[[-1.0]]), head_name("x"): _tv(w=[3.0, 0.0]),
                            head_name("y"): _tv(w=[2.0, 2.0])}, {"x": 30, "y": 20}),
        ClientUpdate(2, 4, {"shared": _tv(a=[2.0, 2.0], b=[[0.0]]), head_name("y"): _tv(w=[-1.0, 1.0])}, {"y": 40}),
    ]


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fedavg_equals_hand_computed_weighted_mean(server_lr):
    new = FedAvg(server_lr=server_lr).server_aggregate(_state(), _updates())
    # shared: weights = total samples 10, 50, 40 (sum 100)
    mean_a = (10 * torch.tensor([1.0, 0.0]) + 50 * torch.tensor([0.0, 1.0]) + 40 * torch.tensor([2.0, 2.0])) / 100
    mean_b = (10 * 1.0 + 50 * -1.0 + 40 * 0.0) / 100
    torch.testing.assert_close(new.vectors["shared"]["a"], torch.tensor([1.0, 2.0]) + server_lr * mean_a)
    torch.testing.assert_close(new.vectors["shared"]["b"], torch.tensor([[0.5 + server_lr * mean_b]]))
    # head x over its holders (10, 30); head y over (20, 40)
    mean_x = (10 * torch.tensor([1.0, 2.0]) + 30 * torch.tensor([3.0, 0.0])) / 40
    mean_y = (20 * torch.tensor([2.0, 2.0]) + 40 * torch.tensor([-1.0, 1.0])) / 60
    torch.testing.assert_close(new.vectors[head_name("x")]["w"], server_lr * mean_x)
    torch.testing.assert_close(new.vectors[head_name("y")]["w"], torch.tensor([1.0, 1.0]) + server_lr * mean_y)
    assert new.round == 4


def test_head_of_task_without_participants_is_unchanged():
    updates = [u for u in _updates() if "y" not in u.num_samples]
    new = FedAvg().server_aggregate(_state(), updates)
    assert torch.equal(new.vectors[head_name("y")]["w"], torch.tensor([1.0, 1.0]))


def test_build_strategy_types_its_options_and_rejects_unknown_names():
    s = build_strategy("fedprox", {"proximal_mu": 0.3, "server_lr": 1})
    assert isinstance(s, FedProx) and s.config.proximal_mu == 0.3 and s.config.server_lr == 1.0
    assert isinstance(s.config.server_lr, float)
    with pytest.raises(ConfigError, match="fedavgg"):
        build_strategy("fedavgg", {})
    with pytest.raises(ConfigError, match="'fedavg' does not support option 'proximal_mu' "
                                          "\\(an option of fedprox, ntkfedprox\\)"):
        build_strategy("fedavg", {"proximal_mu": 0.3})
    with pytest.raises(ConfigError, match="learning_rate"):  # a run setting, not a strategy option
        build_strategy("fedprox", {"learning_rate": 1.0})
    with pytest.raises(ConfigError, match="proximal_mu: expected a number, got 'big'"):
        build_strategy("fedprox", {"proximal_mu": "big"})
