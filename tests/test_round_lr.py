"""The round-aware learning rate (`lr_round_schedule`, `hf_fedtask.client.round_schedule`): FlowerTune's
cosine_annealing by hand; every client loop (Trainer, lean, batched) steps its optimizer at the round's rate,
recorded in metrics.jsonl; the round reaches a Flower ClientApp; a cosine run refuses a resume with other rounds;
an option with no effect is refused."""

from __future__ import annotations

import json
import math

import pytest
from conftest import make_config, read_records
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hf_fedtask.client import lean as lean_module
from hf_fedtask.client.round_schedule import cosine_annealing, round_learning_rate
from hf_fedtask.client.trainer import LocalTrainingArgs
from hf_fedtask.config import RunConfig
from hf_fedtask.engine.inprocess import Federation
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError, ProtocolError

LR, LR_MIN = 1e-2, 1e-3


def test_cosine_annealing_is_flowertunes_formula_by_hand():
    # FlowerTune's presets (5e-5 -> 1e-6) over 4 rounds: 1e-6 + 0.5 * 4.9e-5 * (1 + cos(pi r / 4))
    assert cosine_annealing(1, 4, 5e-5, 1e-6) == pytest.approx(1e-6 + 0.5 * 4.9e-5 * 1.7071067811865476, rel=1e-12)
    assert cosine_annealing(2, 4, 5e-5, 1e-6) == pytest.approx(2.55e-5, rel=1e-12)  # cos(pi/2) = 0: the midpoint
    assert cosine_annealing(4, 4, 5e-5, 1e-6) == pytest.approx(1e-6, rel=1e-12)  # the last round: the minimum
    assert cosine_annealing(0, 4, 5e-5, 1e-6) == 5e-5
    assert round_learning_rate("constant", 3, 4, 5e-5, 0.0) == 5e-5
    config = RunConfig(learning_rate=5e-5, lr_round_schedule="cosine", learning_rate_min=1e-6, rounds=4)
    args = LocalTrainingArgs.from_run(config)
    assert args.for_round(2, 4).learning_rate == cosine_annealing(2, 4, 5e-5, 1e-6)
    assert args.for_round(2, 4).local_steps == args.local_steps  # only the rate changes
    constant = LocalTrainingArgs.from_run(RunConfig(learning_rate=5e-5))
    assert constant.for_round(2, 4) is constant


@pytest.fixture
def optimizer_rates():
    """Every optimizer step's learning rate (param group 0), through torch's global step hook."""
    rates: list[float] = []
    handle = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: rates.append(float(optimizer.param_groups[0]["lr"])))
    yield rates
    handle.remove()


LOOPS = {
    "trainer": dict(client_loop="trainer", batch_clients="off"),
    "lean": dict(client_loop="lean", batch_clients="off"),
    # the small MLP's fixed-shape inputs: the round's clients trained together (hf_fedtask.client.batched)
    "batched": dict(client_loop="lean", batch_clients="auto", tasks=["digits"], base_model="hf-fedtask/small-mlp",
                    base_model_id=None, peft_method="full", batch_size=16),
}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_every_client_loop_steps_at_the_rounds_cosine_rate(loop, optimizer_rates, tiny_bert_dir, tiny_tasks_dir,
                                                           tmp_path):
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / loop, rounds=3, local_steps=2,
                         lr_scheduler="constant", learning_rate=LR, lr_round_schedule="cosine",
                         learning_rate_min=LR_MIN, **LOOPS[loop])
    fed = Federation(config)
    state = fed.initial_state()
    for r in (1, 2, 3):
        optimizer_rates.clear()
        state, record = fed.run_round(state, r)
        expected = LR_MIN + 0.5 * (LR - LR_MIN) * (1 + math.cos(math.pi * r / 3))
        assert optimizer_rates and all(rate == pytest.approx(expected, rel=1e-12) for rate in optimizer_rates), r
        assert record["learning_rate"] == pytest.approx(expected, rel=1e-12)
    assert fed.trainer.loop == ("trainer" if loop == "trainer" else "lean")
    assert fed.trainer.batches_clients == (loop == "batched")
    assert fed.trainer.current is fed.trainer.args  # the run's recipe again between rounds


def test_a_constant_schedule_rebuilds_nothing_and_records_the_rate(tiny_bert_dir, tiny_tasks_dir, tmp_path,
                                                                   monkeypatch, optimizer_rates):
    retargets = []
    retarget = lean_module.LeanLoop.retarget
    monkeypatch.setattr(lean_module.LeanLoop, "retarget", lambda self, t: retargets.append(t) or retarget(self, t))
    fed = Federation(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "c", lr_scheduler="constant",
                                 client_loop="lean"))
    _, record = fed.run_round(fed.initial_state(), 1)
    assert len(retargets) == 1  # built once with the trainer, never per round
    assert record["learning_rate"] == 1e-2 and set(optimizer_rates) == {1e-2}


def test_the_round_reaches_a_flower_client_app(optimizer_rates, tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """The real ServerApp and ClientApp over the in-process Grid: the ClientApps step at round 1's rate, then at
    round 2's, and the run equals the in-process one tensor for tensor."""
    pytest.importorskip("flwr")
    from test_flower import assert_same_run, drive, tiny

    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", rounds=2, learning_rate=LR,
                  lr_round_schedule="cosine", learning_rate_min=LR_MIN, lr_scheduler="constant")
    drive(config)
    first, last = (cosine_annealing(r, 2, LR, LR_MIN) for r in (1, 2))
    assert optimizer_rates[0] == pytest.approx(first, rel=1e-12) and optimizer_rates[-1] == pytest.approx(LR_MIN)
    switch = next(i for i, rate in enumerate(optimizer_rates) if rate != optimizer_rates[0])
    assert all(rate == pytest.approx(first, rel=1e-12) for rate in optimizer_rates[:switch])
    assert all(rate == pytest.approx(last, rel=1e-12) for rate in optimizer_rates[switch:])
    reference = tmp_path / "reference"
    run(RunConfig.from_dict({**config.to_dict(), "output_dir": str(reference)}))
    assert_same_run(reference, tmp_path / "flower")
    assert [r["learning_rate"] for r in read_records(tmp_path / "flower")] == [
        pytest.approx(cosine_annealing(r, 2, LR, LR_MIN), rel=1e-12) for r in (1, 2)]


def test_a_round_outside_the_run_is_refused_by_a_cosine_client(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """The round arrives in the server's instruction: past the last round the cosine would climb again, so the
    client refuses it rather than train at a rate the run never set; a constant schedule has a rate for any."""
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "c", rounds=2, lr_round_schedule="cosine",
                         learning_rate=LR, learning_rate_min=LR_MIN)
    fed = Federation(config)
    with pytest.raises(ProtocolError, match=r"round 3 is outside this run's rounds 1\.\.2: lr_round_schedule cosine"):
        fed.run_round(fed.initial_state(), 3)
    constant = Federation(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "k", rounds=2))
    assert constant.run_round(constant.initial_state(), 3)[1]["learning_rate"] == 1e-2


def test_a_cosine_run_resumes_only_with_its_rounds(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    out = tmp_path / "run"
    config = make_config(tiny_bert_dir, tiny_tasks_dir, out, rounds=2, lr_round_schedule="cosine",
                         learning_rate_min=LR_MIN, export=False)
    run(config)
    before = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "run_config.yaml",
                                                           "checkpoint.safetensors")}
    longer = RunConfig.from_dict({**config.to_dict(), "rounds": 3})
    with pytest.raises(ConfigError, match=r"^rounds: 3 .*lr_round_schedule cosine.*resume with --rounds 2") as e:
        run(longer, resume=True)
    assert "\n" not in str(e.value)
    assert {name: (out / name).read_bytes() for name in before} == before  # nothing written
    # ending the run where it stands trains no round: allowed (what a run stopped by its comm budget needs)
    run(RunConfig.from_dict({**config.to_dict(), "rounds": 2}), resume=True)
    # a constant run may still be resumed with more rounds
    steady = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "constant", rounds=1, export=False)
    run(steady)
    run(RunConfig.from_dict({**steady.to_dict(), "rounds": 2}), resume=True)
    assert [r["round"] for r in read_records(tmp_path / "constant")] == [1, 2]


@pytest.mark.parametrize("values,message", [
    ({"learning_rate_min": 1e-4}, "learning_rate_min: 0.0001 has no effect with lr_round_schedule constant"),
    ({"lr_round_schedule": "cosine", "learning_rate_min": 0.1, "learning_rate": 0.01},
     "learning_rate_min: 0.1 is above learning_rate 0.01"),
    ({"lr_round_schedule": "linear"}, "lr_round_schedule: must be one of constant, cosine"),
])
def test_an_option_with_no_effect_or_out_of_range_is_one_line(values, message, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(values))
    with pytest.raises(ConfigError, match=message) as e:
        RunConfig.from_yaml(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_f2l2_cg_refuses_the_round_schedule():
    from hf_fedtask.strategies import build_strategy

    config = RunConfig(strategy="f2l2", suite=None, tasks=["colors"], rounds=3, lr_round_schedule="cosine",
                       strategy_options={"linear_solver": "cg"})
    with pytest.raises(ConfigError, match="lr_round_schedule"):
        build_strategy(config.strategy, config.strategy_options).check_run(config)


@pytest.mark.parametrize("challenge", ["code", "finance", "general", "medical"])
def test_the_flowertune_presets_anneal_as_the_template_apps(challenge):
    from pathlib import Path

    config = RunConfig.from_yaml(Path(__file__).parents[1] / "recipes" / "presets" / f"flowertune_{challenge}.yaml")
    assert (config.lr_round_schedule, config.learning_rate, config.learning_rate_min) == ("cosine", 5e-5, 1e-6)
    args = LocalTrainingArgs.from_run(config)
    assert args.for_round(config.rounds, config.rounds).learning_rate == pytest.approx(1e-6, rel=1e-12)
    assert args.for_round(100, 200).learning_rate == pytest.approx((5e-5 + 1e-6) / 2, rel=1e-12)


@pytest.mark.slow
def test_torchrun_ranks_train_at_the_rounds_rate(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """Two torchrun ranks (clients on rank 1 too) give the one-process cosine run tensor for tensor."""
    import dataclasses

    import torch
    from test_accelerators import _config, _tensors, _torchrun

    config = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "one", participation=1.0, lr_scheduler="constant",
                     lr_round_schedule="cosine", learning_rate_min=LR_MIN)
    run(config)
    proc = _torchrun(tmp_path, dataclasses.replace(config, output_dir=str(tmp_path / "two")))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    one, two = _tensors(tmp_path / "one"), _tensors(tmp_path / "two")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert [r["learning_rate"] for r in read_records(tmp_path / "two")] == [
        pytest.approx(cosine_annealing(r, 2, 1e-2, LR_MIN), rel=1e-12) for r in (1, 2)]
