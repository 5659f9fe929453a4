"""NTKFedAvg / NTKFedProx, federated and one-shot unlearning, and the linearized export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_fedtask.cli import main
from hf_fedtask.client.evaluation import evaluate
from hf_fedtask.core.state import POINT, tracked_task_vector_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.engine import run as federation
from hf_fedtask.errors import ConfigError
from hf_fedtask.export.linearized import load_linearized
from hf_fedtask.strategies import build_strategy
from hf_fedtask.strategies.base import SHARED, ClientJob, GlobalState, head_name
from hf_fedtask.strategies.fedavg import accumulate_task_vectors, negate_forgotten
from hf_fedtask.workflows.unlearn import negate_task, unlearn


def tv(*values):
    return TaskVector({"w": torch.tensor(values, dtype=torch.float32)})


def update(cid, vec, tasks):
    return ClientUpdate(cid, 1, {SHARED: vec, **{head_name(t): tv(1.0) for t in tasks}}, tasks, {})


def test_negation_and_task_vector_bookkeeping():
    a, b = update(0, tv(1.0, 2.0), {"x": 1}), update(1, tv(3.0, -1.0), {"y": 2, "z": 1})
    flipped = negate_forgotten([a, b], ["x"])
    assert torch.equal(flipped[0].vectors[SHARED]["w"], torch.tensor([-1.0, -2.0]))
    assert torch.equal(flipped[0].vectors[head_name("x")]["w"], torch.tensor([-1.0]))
    assert flipped[1] is b

    strategy = build_strategy("fedavg", {"server_lr": 0.5, "forget_tasks": ["x"], "track_task_vectors": True})
    zero = tv(0.0, 0.0)
    state = GlobalState(0, {SHARED: zero, **{head_name(t): tv(0.0) for t in "xyz"},
                            **{tracked_task_vector_name(t): zero for t in "xyz"}}, {"allocation": {}})
    new = strategy.server_aggregate(state, [a, b])
    # θ + α·(−1·τ_a + 3·τ_b)/4 over the 4 samples
    expected = 0.5 * (-1 * torch.tensor([1.0, 2.0]) + 3 * torch.tensor([3.0, -1.0])) / 4
    assert torch.allclose(new.vectors[SHARED]["w"], expected)
    # b's step splits over its tasks y:z = 2:1, and the task vectors sum to the movement
    assert torch.allclose(new.vectors[tracked_task_vector_name("y")]["w"], 0.5 * torch.tensor([3.0, -1.0]) * 2 / 4)
    total = sum((new.vectors[tracked_task_vector_name(t)]["w"] for t in "xyz"), torch.zeros(2))
    assert torch.allclose(total, expected)
    again = accumulate_task_vectors(new, negate_forgotten([a, b], ["x"]), 0.5)
    assert torch.allclose(sum((again[tracked_task_vector_name(t)]["w"] for t in "xyz"), torch.zeros(2)), 2 * expected)


def test_server_step_keeps_the_previous_state_as_linearization_point():
    strategy = build_strategy("ntkfedavg", {"server_lr": 1.0})
    head = lambda v: TaskVector({"h": torch.tensor([v])})  # noqa: E731  (the head's own key, apart from "w")
    state = GlobalState(3, {SHARED: tv(1.0), head_name("x"): head(2.0), POINT + SHARED: tv(0.0),
                            POINT + head_name("x"): head(0.0)}, {"allocation": {}})
    new = strategy.server_aggregate(state, [ClientUpdate(0, 4, {SHARED: tv(0.5), head_name("x"): head(1.0)},
                                                         {"x": 4}, {})])
    assert new.vectors[SHARED]["w"].item() == 1.5 and new.vectors[head_name("x")]["h"].item() == 3.0
    point = strategy.linearization_point(new, "x")  # the previous state: shared modules and the task's head
    assert set(point) == {"w", "h"} and point["w"].item() == 1.0 and point["h"].item() == 2.0
    assert new.vectors[POINT + SHARED]["w"].item() == 1.0 and new.vectors[POINT + head_name("x")]["h"].item() == 2.0
    pretrained = build_strategy("ntkfedavg", {"linearize_at": "pretrained"})
    assert pretrained.server_aggregate(state, [ClientUpdate(0, 4, {SHARED: tv(0.5), head_name("x"): head(1.0)},
                                                            {"x": 4}, {})]).vectors[POINT + SHARED]["w"].item() == 0.0
    with pytest.raises(ConfigError, match="linearize_at"):
        build_strategy("ntkfedavg", {"linearize_at": "origin"})
    with pytest.raises(ConfigError, match="linearization"):
        build_strategy("ntkfedavg", {"linearization": "quadratic"})


@pytest.mark.parametrize("linearize_at", ["server", "pretrained"])
def test_clients_train_the_model_linearized_at_the_chosen_point(tiny_config, linearize_at):
    tiny_config.strategy = "ntkfedavg"
    tiny_config.strategy_options["linearize_at"] = linearize_at
    sim = federation.Federation(tiny_config)
    state = sim.initial_state()
    state.vectors[SHARED] = TaskVector({k: v + 0.01 for k, v in state.vectors[SHARED].items()})  # θ_s ≠ θ_0
    task = min(sim.client_data(0))
    job = ClientJob(0, 1, sim.client_data(0), seed=0, origin=sim.origin, initial_heads=sim.initial_heads)
    downlink = sim.strategy.downlink(state, 0, [task])
    got = sim.strategy.client_update(downlink, job, sim.trainer).vectors[SHARED]
    start = TaskVector({**downlink[SHARED], **downlink[head_name(task)]})
    point = start if linearize_at == "server" else TaskVector({**sim.origin, **sim.initial_heads[task]})
    by_hand, _ = sim.trainer.train(start, sim.client_data(0)[task], seed=job.seed_for(task), linearize_at=point)
    plain, _ = sim.trainer.train(start, sim.client_data(0)[task], seed=job.seed_for(task))
    shared = by_hand.filter(lambda k: k in downlink[SHARED]) - downlink[SHARED]
    assert all(torch.allclose(got[k], shared[k], atol=1e-7) for k in got)
    assert not all(torch.allclose(got[k], (plain.filter(lambda k: k in got) - downlink[SHARED])[k]) for k in got)


@pytest.fixture(scope="module")
def ntk_run(tmp_path_factory, tiny_bert_dir, tiny_tasks_dir):
    from conftest import TINY_MODEL_ID

    from hf_fedtask.config import RunConfig

    config = RunConfig(strategy="ntkfedavg", suite=None, tasks=tiny_tasks_dir, base_model=tiny_bert_dir,
                       base_model_id=TINY_MODEL_ID, num_clients=2, rounds=2, batch_size=8, local_steps=4,
                       learning_rate=2e-2, max_length=16, min_samples=4, strategy_options={"track_task_vectors": True},
                       output_dir=str(tmp_path_factory.mktemp("ntk") / "run"))
    return config, federation.run(config)


def test_run_reports_linearized_and_nonlinear_and_exports_both(ntk_run, tiny_bert_dir):
    config, results = ntk_run
    run_dir = Path(config.output_dir)
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("mean_metric_nonlinear" in h for h in history)
    sim = federation.Federation(config)
    from hf_fedtask.core.checkpoint import load_checkpoint

    state, _, _ = load_checkpoint(run_dir, fingerprint=config.fingerprint(), template=sim.initial_state())
    for task in sim.tasks:
        params = sim.strategy.task_parameters(state, task.name)
        point = sim.strategy.linearization_point(state, task.name)
        lin = evaluate(sim.host, params, sim.test_data(task.name), linearize_at=point)["accuracy"]
        nonlin = evaluate(sim.host, params, sim.test_data(task.name))["accuracy"]
        assert results["tasks"][task.name]["accuracy"] == lin
        assert results["tasks"][task.name]["accuracy_nonlinear"] == nonlin

        # the linearized package computes the same f_lin; the stock adapter is the non-linear model
        model = load_linearized(run_dir / "linearized" / task.name, base_model=tiny_bert_dir)
        loader = torch.utils.data.DataLoader(sim.test_data(task.name), batch_size=64,
                                             collate_fn=sim.host.inputs.collator)
        with torch.no_grad():
            preds = torch.cat([model(**{k: v for k, v in b.items() if k != "labels"}).logits.argmax(-1)
                               for b in loader])
        assert float(np.mean(preds.numpy() == np.asarray(sim.test_data(task.name)["labels"]))) == lin
        card = (run_dir / "adapters" / task.name / "README.md").read_text()
        assert "Linearized training" in card and f"accuracy {nonlin:.4f}" in card


def test_federated_unlearning_continues_the_run_with_the_task_negated(ntk_run):
    config, _ = ntk_run
    run_dir = Path(config.output_dir)
    original = (run_dir / "checkpoint.safetensors").read_bytes()
    forget = "colors"
    results = unlearn(run_dir, forget, rounds=1)
    out = run_dir.with_name(f"{run_dir.name}-unlearn-{forget}")
    assert (run_dir / "checkpoint.safetensors").read_bytes() == original  # the original run is untouched
    u = results["unlearning"]
    assert u["from_round"] == 3 and u["rounds"] == 1 and u["tasks"] == [forget]
    assert u["clients"] == [c for c, ts in federation.Federation(config).allocation.items() if forget in ts]
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [1, 2, 3] and "forgotten" in history[-1]
    assert history[-1]["forgotten"] == {forget: history[-1]["eval"][forget]["accuracy"]}
    assert (out / "unlearning.png").stat().st_size > 0
    assert "Unlearned task(s) `colors`" in (out / "adapters" / forget / "README.md").read_text()
    # the negation is the only difference from continuing normally: clients train identically (same
    # state, same seeds), so the forgotten task's step flips sign and the other task's is unchanged
    plain = out.with_name("plain3")
    federation.run(federation.RunConfig.from_dict({**config.to_dict(), "rounds": 3, "output_dir": str(plain)}),
                   warm_start=run_dir)
    step = {name: _task_vector_step(folder, run_dir) for name, folder in (("unlearn", out), ("plain", plain))}
    for k in step["plain"]["colors"]:
        assert torch.allclose(step["unlearn"]["colors"][k], -step["plain"]["colors"][k], atol=1e-7)
        assert torch.allclose(step["unlearn"]["moods"][k], step["plain"]["moods"][k], atol=1e-7)
    assert any(v.abs().max() > 0 for v in step["plain"]["colors"].values())


def _task_vector_step(run_dir: Path, parent: Path) -> dict[str, TaskVector]:
    """What the last round added to each task's recorded vector."""
    from safetensors.torch import load_file

    new, old = load_file(run_dir / "checkpoint.safetensors"), load_file(parent / "checkpoint.safetensors")
    out = {}
    for task in ("colors", "moods"):
        prefix = tracked_task_vector_name(task) + "::"
        out[task] = TaskVector({k[len(prefix):]: new[k] - old[k] for k in new if k.startswith(prefix)})
    return out


def test_one_shot_negation_subtracts_the_recorded_task_vector(ntk_run):
    config, _ = ntk_run
    run_dir = Path(config.output_dir)
    results = negate_task(run_dir, "moods", scale=1.0)
    out = run_dir.with_name(f"{run_dir.name}-negate-moods")
    from safetensors.torch import load_file

    sim = federation.Federation(config)
    from hf_fedtask.core.checkpoint import load_checkpoint

    state, _, _ = load_checkpoint(run_dir, fingerprint=config.fingerprint(), template=sim.initial_state())
    # the task vectors add up to the shared modules' movement since round 0
    total = sum((state.vectors[tracked_task_vector_name(t)] for t in ("colors", "moods")),
                state.vectors[SHARED].zeros_like())
    moved = state.vectors[SHARED] - sim.origin
    assert all(torch.allclose(total[k], moved[k], atol=1e-6) for k in moved)
    saved = load_file(out / "adapters" / "colors" / "adapter_model.safetensors")
    expected = state.vectors[SHARED] - state.vectors[tracked_task_vector_name("moods")]
    assert all(torch.allclose(saved[k], expected[k]) for k in expected)
    assert results["unlearning"]["scale"] == 1.0
    head = load_file(out / "adapters" / "moods" / "adapter_model.safetensors")
    assert all(torch.allclose(head[k], sim.initial_heads["moods"][k]) for k in sim.initial_heads["moods"])
    assert "subtracted from the merged model" in (out / "adapters" / "moods" / "README.md").read_text()


def test_unlearning_errors_are_one_line_and_write_nothing(ntk_run, tmp_path, capsys):
    config, _ = ntk_run
    run_dir = config.output_dir
    assert main(["unlearn", run_dir, "--task", "planets", "--rounds", "1", "--output-dir", str(tmp_path / "u")]) == 2
    assert "unknown task 'planets'" in capsys.readouterr().err
    assert not (tmp_path / "u" / "checkpoint.safetensors").exists()
    assert main(["unlearn", str(tmp_path), "--task", "colors", "--rounds", "1"]) == 2
    assert "not a finished hf_fedtask run" in capsys.readouterr().err
    assert main(["unlearn", run_dir, "--task", "colors"]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_unlearning_needs_a_fedavg_family_strategy(tiny_config):
    tiny_config.strategy = "matu"
    tiny_config.strategy_options["forget_tasks"] = ["colors"]
    with pytest.raises(ConfigError, match="'matu' does not support option 'forget_tasks'"):
        federation.Federation(tiny_config)


def test_ntkfedprox_adds_the_proximal_term_to_linearized_training(tiny_config):
    tiny_config.strategy = "ntkfedprox"
    tiny_config.strategy_options["proximal_mu"] = 1.0
    sim = federation.Federation(tiny_config)
    state = sim.initial_state()
    task = min(sim.client_data(0))
    job = ClientJob(0, 1, sim.client_data(0), seed=0, origin=sim.origin, initial_heads=sim.initial_heads)
    downlink = sim.strategy.downlink(state, 0, [task])
    options = sim.strategy._train_options(downlink, job, task)
    (prox_term,) = options["objectives"]
    assert prox_term.mu == 1.0 and set(options["linearize_at"]) == set(sim.host.state())
    start = TaskVector({**downlink[SHARED], **downlink[head_name(task)]})
    data = sim.client_data(0)[task]
    prox, _ = sim.trainer.train(start, data, seed=1, **options)
    free, _ = sim.trainer.train(start, data, seed=1, linearize_at=options["linearize_at"])
    # the pull towards θ_s shortens the step
    assert sum((prox - start)[k].norm() ** 2 for k in start) < sum((free - start)[k].norm() ** 2 for k in start)
