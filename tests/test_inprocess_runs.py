"""End-to-end runs of the simulator on a tiny model: outputs, PEFT reload, resume, bad input."""

import json
from pathlib import Path

import pytest
import torch
from conftest import Crash, assert_stock_reload_matches, crash_after, tensors_equal
from safetensors.torch import load_file

from hf_fedtask.cli import main
from hf_fedtask.config import RunConfig
from hf_fedtask.engine import run as federation
from hf_fedtask.errors import OutputDirError, TaskVectorError, UntrustedUpload
from hf_fedtask.strategies import FedAvg


def test_run_writes_metrics_results_checkpoint_and_peft_adapters(tiny_config):
    results = federation.run(tiny_config)
    run_dir = Path(tiny_config.output_dir)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [1, 2]
    assert all(r["bytes_uplink"] > 0 and r["bytes_downlink"] > 0 for r in lines)
    on_disk = json.loads((run_dir / "results.json").read_text())
    assert on_disk["rounds"] == 2 and set(on_disk["tasks"]) == {"colors", "moods"}
    assert on_disk["tasks"]["colors"]["num_examples"] == 18
    # the shipped reference belongs to the MiniLM builtin suite, never to another base model's tasks
    assert on_disk["mean_normalized"] is None and "normalized" not in on_disk["tasks"]["colors"]
    assert (run_dir / "accuracy_vs_round.png").stat().st_size > 0
    for task, r in results["tasks"].items():
        folder = run_dir / "adapters" / task
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "hf-fedtask-tests/tiny-bert"
        assert (load_file(folder / "adapter_model.safetensors")["base_model.model.classifier.weight"].shape[0]
                == r["num_labels"])
        assert (folder / "README.md").exists()


def test_exported_adapter_reloads_with_stock_peft_to_identical_logits(tiny_config, tiny_bert_dir):

    federation.run(tiny_config)
    run_dir = Path(tiny_config.output_dir)
    sim = federation.Federation(tiny_config)
    from hf_fedtask.core.checkpoint import load_checkpoint

    state, _, _ = load_checkpoint(run_dir, fingerprint=tiny_config.fingerprint(), template=sim.initial_state())
    assert_stock_reload_matches(sim, state, tiny_bert_dir, run_dir / "adapters" / "colors")


def test_standalone_evaluation_matches_results_json(tiny_config, tiny_tasks_dir):
    from hf_fedtask.export.standalone import evaluate_adapter

    results = federation.run(tiny_config)
    run_dir = Path(tiny_config.output_dir)
    for path in tiny_tasks_dir:
        name = Path(path).name
        # the tiny base is a local folder; point the adapter at it as a user with the Hub id would
        cfg_file = run_dir / "adapters" / name / "adapter_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["base_model_name_or_path"] = tiny_config.base_model
        cfg_file.write_text(json.dumps(cfg))
        got = evaluate_adapter(run_dir / "adapters" / name, path, max_length=tiny_config.max_length)
        assert got["accuracy"] == pytest.approx(results["tasks"][name]["accuracy"], abs=1e-9)


def test_killed_and_resumed_run_equals_uninterrupted_bit_for_bit(tiny_config, tmp_path):
    tiny_config.rounds = 3
    straight = RunConfig(**{**tiny_config.to_dict(), "output_dir": str(tmp_path / "straight")})
    federation.run(straight)
    with pytest.raises(Crash):
        federation.run(tiny_config, callbacks=[crash_after(2)])
    assert len((Path(tiny_config.output_dir) / "metrics.jsonl").read_text().splitlines()) == 2
    federation.run(tiny_config, resume=True)
    a = load_file(Path(straight.output_dir) / "checkpoint.safetensors")
    b = load_file(Path(tiny_config.output_dir) / "checkpoint.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda p: [{k: v for k, v in json.loads(x).items() if k != "seconds"} for x in p.read_text().splitlines()]  # noqa: E731
    assert strip(Path(straight.output_dir) / "metrics.jsonl") == strip(Path(tiny_config.output_dir) / "metrics.jsonl")


def test_training_seed_changes_the_training_order_alone(tiny_config, tmp_path):
    """`training_seed` reorders the clients' local training and nothing else: the same partition and
    initialization, another final model; equal to `seed` it is the plain run, bit for bit; and it makes
    another run (the fingerprint), so a resume cannot mix two orders."""
    from hf_fedtask.engine.environment import Environment

    runs = {}
    for name, training_seed in {"plain": None, "same": tiny_config.seed, "other": tiny_config.seed + 1}.items():
        config = RunConfig(**{**tiny_config.to_dict(), "training_seed": training_seed,
                              "output_dir": str(tmp_path / name)})
        federation.run(config)
        runs[name] = (config, load_file(tmp_path / name / "checkpoint.safetensors"))
    (plain, a), (same, b), (other, c) = runs.values()
    assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    first, second = Environment(plain), Environment(other)
    assert all(first.partition[k][t].to_dict() == second.partition[k][t].to_dict()
               for k in range(plain.num_clients) for t in first.partition[k])
    start, again = first.initial_state().vectors, second.initial_state().vectors
    assert start.keys() == again.keys() and all(tensors_equal(start[k], again[k]) for k in start)
    assert plain.fingerprint() != other.fingerprint()


def test_nan_update_is_rejected_naming_the_client_and_nothing_is_written(tiny_config, monkeypatch):
    original = FedAvg.client_update

    def poisoned(self, downlink, job, trainer):
        update = original(self, downlink, job, trainer)
        if job.client_id == 1:
            key = next(iter(update.vectors["shared"]))
            update.vectors["shared"][key][0] = float("nan")
        return update

    monkeypatch.setattr(FedAvg, "client_update", poisoned)
    tiny_config.bad_uploads = "stop"
    with pytest.raises(UntrustedUpload, match=r"^client 1, round 1: refused upload: key 'shared::.*lora.*NaN"):
        federation.run(tiny_config)
    assert not (Path(tiny_config.output_dir) / "checkpoint.safetensors").exists()
    tiny_config.bad_uploads, tiny_config.rounds = "drop", 1  # the default: the round goes on without client 1
    federation.run(tiny_config, overwrite=True)
    (record,) = [json.loads(line) for line in (Path(tiny_config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert record["clients"] == [0, 2, 3] and "NaN or Inf" in record["failed_clients"]["1"]


def test_different_run_in_output_dir_is_refused_and_untouched(tiny_config, capsys):
    tiny_config.rounds = 1
    federation.run(tiny_config)
    run_dir = Path(tiny_config.output_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    other = RunConfig(**{**tiny_config.to_dict(), "learning_rate": 0.5})
    with pytest.raises(OutputDirError, match="learning_rate"):
        federation.run(other)
    with pytest.raises(OutputDirError, match="--resume"):
        federation.run(tiny_config)
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_cli_reports_bad_names_in_one_line_with_nonzero_exit(tiny_config, capsys, tmp_path):
    assert main(["run", "--strategy", "fedsgd", "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fedsgd" in err
    assert main(["run", "--suite", "builtin-999", "--output-dir", str(tmp_path / "y")]) == 2
    assert "builtin-999" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_corrupt_checkpoint_on_resume_is_an_error_that_names_the_file(tiny_config):
    tiny_config.rounds = 1
    federation.run(tiny_config)
    ckpt = Path(tiny_config.output_dir) / "checkpoint.safetensors"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    tiny_config.rounds = 2
    with pytest.raises(TaskVectorError, match="checkpoint.safetensors"):
        federation.run(tiny_config, resume=True)
    assert ckpt.read_bytes() == data[: len(data) // 2]


@pytest.mark.parametrize("method", ["ia3", "prompt", "prefix"])
def test_every_peft_method_trains_exports_and_reloads(tiny_config, method):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    tiny_config.peft_method, tiny_config.rounds, tiny_config.num_virtual_tokens = method, 1, 4
    federation.run(tiny_config)
    run_dir = Path(tiny_config.output_dir)
    ckpt = load_file(run_dir / "checkpoint.safetensors")
    shared = {k: v for k, v in ckpt.items() if k.startswith("shared::")}
    assert shared, "the PEFT modules must be part of the server state"
    adapter = run_dir / "adapters" / "moods"
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"].lower().startswith(method[:3])
    # stock PEFT reloads the exported adapter to the logits of the run's own model of the task
    from transformers import AutoTokenizer

    from hf_fedtask.core.checkpoint import load_checkpoint

    sim = federation.Federation(tiny_config)
    state, _, _ = load_checkpoint(run_dir, fingerprint=tiny_config.fingerprint(), template=sim.initial_state())
    batch = AutoTokenizer.from_pretrained(tiny_config.base_model)(["happy day number 3", "sad night number 8"],
                                                                  padding=True, return_tensors="pt")
    sim.host.load_state(sim.strategy.task_parameters(state, "moods"))
    with torch.no_grad():
        expected = sim.host.model.eval()(**batch).logits
        base = AutoModelForSequenceClassification.from_pretrained(tiny_config.base_model, num_labels=2)
        loaded = PeftModel.from_pretrained(base, adapter).eval()
        torch.testing.assert_close(loaded(**batch).logits, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(expected, torch.zeros_like(expected))


def test_fedprox_term_pulls_clients_toward_the_server(tiny_config, tmp_path):
    """With a large mu, client updates shrink relative to plain FedAvg from the same start."""
    from hf_fedtask.strategies import ClientJob, build_strategy

    sim = federation.Federation(tiny_config)
    job = ClientJob(client_id=0, round=1, data=sim.client_data(0), seed=0)
    norms = {}
    for name, options in (("fedavg", {}), ("fedprox", {"proximal_mu": 50.0})):
        strategy = build_strategy(name, options)
        state = strategy.init_state(sim.host, sim.tasks, 0, sim.allocation)
        downlink = strategy.downlink(state, 0, job.tasks)
        norms[name] = strategy.client_update(downlink, job, sim.trainer).vectors["shared"].norm()
    assert norms["fedprox"] < 0.8 * norms["fedavg"]


def test_proximal_loss_is_half_mu_times_squared_distance(tiny_config, tmp_path):
    from transformers import TrainingArguments

    from hf_fedtask.client.objectives import ProximalTerm
    from hf_fedtask.client.trainer import _ObjectiveTrainer

    sim = federation.Federation(tiny_config)
    task = next(iter(sim.client_data(0)))
    data = sim.client_data(0)[task]
    sim.host.load_state(sim.strategy.task_parameters(sim.initial_state(), task))
    batch = sim.trainer.collator([data[i] for i in range(4)])
    model = sim.host.model
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    plain = _ObjectiveTrainer(model=model, args=args)
    prox = _ObjectiveTrainer(model=model, args=args, objectives=[ProximalTerm(3.0)],
                             params=sim.host.trainable_by_name())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(sim.host.trainable_by_name()) == len(trainable)  # every trainable parameter, by its saved name
    with torch.no_grad():
        for p in trainable:
            p.add_(0.01)
    expected = 1.5 * sum(float((torch.full_like(p, 0.01) ** 2).sum()) for p in trainable)
    model.eval()
    with torch.no_grad():
        diff = prox.compute_loss(model, dict(batch)) - plain.compute_loss(model, dict(batch))
    assert float(diff) == pytest.approx(expected, rel=1e-4)


def test_report_to_tensorboard_writes_event_files(tiny_config):
    tiny_config.rounds, tiny_config.report_to, tiny_config.export = 1, ["tensorboard"], False
    federation.run(tiny_config)
    events = list((Path(tiny_config.output_dir) / "logs").rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_unknown_task_name_is_one_line_and_fast(tmp_path, capsys):
    assert main(["run", "--tasks", "no_such_task_anywhere", "--output-dir", str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_task_anywhere" in err
