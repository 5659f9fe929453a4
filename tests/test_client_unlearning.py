"""Clients as the unit of removal: `forget_clients` negates exactly that client's update, `unlearn` of a
client continues a finished run with its update negated, and its errors are one line."""

from __future__ import annotations

import pytest
import torch
from conftest import read_records

from hf_fedtask.cli import main
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.engine.run_folder import open_finished_run
from hf_fedtask.errors import ConfigError
from hf_fedtask.strategies import GlobalState, build_strategy, head_name
from hf_fedtask.strategies.base import SHARED
from hf_fedtask.workflows.unlearn import unlearn


def _tv(*values):
    return TaskVector({"w": torch.tensor(values, dtype=torch.float32)})


def test_forget_clients_negates_exactly_that_clients_update():
    """fedavg with forget_clients=[1] aggregates as if client 1's update (shared and head) were negated,
    and only client 1's: client 0 holds the same task and is kept; the inputs are left as they were."""
    state = GlobalState(0, {SHARED: _tv(0.0, 0.0), head_name("x"): _tv(0.0), head_name("y"): _tv(0.0)},
                        {"allocation": {"0": ["x"], "1": ["x"], "2": ["y"]}})
    updates = [ClientUpdate(0, 1, {SHARED: _tv(1.0, 2.0), head_name("x"): _tv(1.0)}, {"x": 1}),
               ClientUpdate(1, 1, {SHARED: _tv(3.0, -1.0), head_name("x"): _tv(2.0)}, {"x": 2}),
               ClientUpdate(2, 1, {SHARED: _tv(0.5, 0.5), head_name("y"): _tv(4.0)}, {"y": 1})]
    forget = build_strategy("fedavg", {"forget_clients": [1]}).server_aggregate(state, updates)
    plain = build_strategy("fedavg")
    by_hand = [updates[0], ClientUpdate(1, 1, {k: -v for k, v in updates[1].vectors.items()}, {"x": 2}), updates[2]]
    expected = plain.server_aggregate(state, by_hand)
    for name in (SHARED, head_name("x"), head_name("y")):
        assert torch.equal(forget.vectors[name]["w"], expected.vectors[name]["w"]), name
    # (1·[1, 2] − 2·[3, −1] + 1·[0.5, 0.5]) / 4 and (1·1 − 2·2) / 3
    assert torch.allclose(forget.vectors[SHARED]["w"], torch.tensor([-4.5, 4.5]) / 4)
    assert torch.allclose(forget.vectors[head_name("x")]["w"], torch.tensor([-1.0]))
    assert not torch.equal(forget.vectors[SHARED]["w"], plain.server_aggregate(state, updates).vectors[SHARED]["w"])
    assert torch.equal(updates[1].vectors[SHARED]["w"], torch.tensor([3.0, -1.0]))
    with pytest.raises(ConfigError, match="forget_clients"):
        build_strategy("fedavg", {"forget_clients": [-1]})


def test_unlearn_a_client_negates_its_update_in_the_continued_run(finished_fedavg, tmp_path):
    """`unlearn(run, None, 1, client=1)` continues the run one round with client 1's update negated: the
    results say so, and the new shared modules are the old plus the sample-weighted mean of the
    uploads with client 1's flipped. The finished run is left as it was."""
    before = (finished_fedavg / CHECKPOINT_FILE).read_bytes()
    out = tmp_path / "forget-1"
    results = unlearn(finished_fedavg, None, 1, client=1, output_dir=out)
    u = results["unlearning"]
    assert u["forgotten_clients"] == [1] and u["clients"] == [1] and u["tasks"] == []
    assert (u["from_round"], u["rounds"], results["rounds"]) == (2, 1, 2)
    assert read_records(out)[-1]["forgotten_clients"] == [1]
    assert (finished_fedavg / CHECKPOINT_FILE).read_bytes() == before

    parent, child = open_finished_run(finished_fedavg), open_finished_run(out)
    strategy, allocation = parent.env.strategy, parent.state.allocation
    uploads = {}
    for c in allocation:
        data = (out / "payloads" / "round_2" / f"client_{c}.uplink.safetensors").read_bytes()
        uploads[c] = ClientUpdate.from_bytes(data, templates=strategy.update_templates(parent.state, c, allocation[c]),
                                             expect=parent.env.header(), source=f"client {c}")
    assert sorted(uploads) == [0, 1, 2, 3]
    total = sum(u.total_samples for u in uploads.values())
    step = sum((u.vectors[SHARED] * ((-1.0 if c == 1 else 1.0) * u.total_samples / total) for c, u in uploads.items()))
    expected = parent.state.vectors[SHARED] + step
    for k, t in expected.items():
        torch.testing.assert_close(child.state.vectors[SHARED][k], t, rtol=1e-5, atol=1e-7)


def test_unlearn_client_errors_are_one_line(finished_fedavg, tmp_path, capsys):
    """Unknown client, task and client together, and --scale without --one-shot are refused (API:
    ConfigError; CLI: exit 2 with one line on stderr) and write nothing."""
    with pytest.raises(ConfigError, match="unknown client 7"):
        unlearn(finished_fedavg, None, 1, client=7, output_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="a task or a client"):
        unlearn(finished_fedavg, "colors", 1, client=1, output_dir=tmp_path / "b")
    cases = [(["--client", "7", "--rounds", "1"], "7"),
             (["--task", "colors", "--client", "1", "--rounds", "1"], "not both"),
             (["--client", "1", "--rounds", "1", "--scale", "2"], "--scale")]
    for i, (flags, expected) in enumerate(cases):
        assert main(["unlearn", str(finished_fedavg), *flags, "--output-dir", str(tmp_path / f"cli{i}")]) == 2
        err = capsys.readouterr().err.strip().splitlines()  # (model-loading progress bars may come first)
        errors = [line for line in err if line.startswith("hf-fedtask:")]
        assert len(errors) == 1 and errors[0] == err[-1] and expected in errors[0], err
        assert not any("Traceback" in line for line in err)
    assert not any((tmp_path / name).exists() for name in ("a", "b", "cli0", "cli1", "cli2"))
