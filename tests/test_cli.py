"""The CLI as a user drives it: run, inspect, export, evaluate, push, suite export."""

import json
from pathlib import Path

import pytest

from hf_fedtask.cli import main


def _run_tiny(tiny_config, capsys):
    c = tiny_config
    argv = ["run", "--tasks", *c.tasks, "--base-model", c.base_model, "--base-model-id", c.base_model_id,
            "--num-clients", "4", "--rounds", "1", "--batch-size", "8", "--local-steps", "2", "--max-length", "16",
            "--min-samples", "4", "--output-dir", c.output_dir]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "colors" in out and "mean" in out
    return Path(c.output_dir)


def test_run_inspect_export_evaluate(tiny_config, tiny_tasks_dir, capsys):
    run_dir = _run_tiny(tiny_config, capsys)
    assert main(["inspect", str(run_dir / "checkpoint.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "shared::base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight" in out
    assert "peft_config_hash" in out

    adapter = run_dir / "adapters" / "colors"
    (adapter / "adapter_model.safetensors").unlink()
    assert main(["export", str(run_dir)]) == 0
    assert (adapter / "adapter_model.safetensors").exists()
    capsys.readouterr()

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = tiny_config.base_model  # the tiny base is local, not on the Hub
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    assert main(["evaluate", str(adapter), "--task", tiny_tasks_dir[0], "--max-length", "16"]) == 0
    got = json.loads(capsys.readouterr().out)
    expected = json.loads((run_dir / "results.json").read_text())["tasks"]["colors"]["accuracy"]
    assert got["accuracy"] == pytest.approx(expected)


def test_push_arrives_byte_identical_and_network_errors_are_one_line(tiny_config, capsys, hub_stub):
    endpoint, store = hub_stub
    run_dir = _run_tiny(tiny_config, capsys)
    adapter = run_dir / "adapters" / "moods"
    assert main(["push", str(adapter), "--repo-id", "me/moods", "--endpoint", endpoint, "--token", "hf_x"]) == 0
    files = [f for f in adapter.rglob("*") if f.is_file()]
    assert "classifier/config.json" in {f.relative_to(adapter).as_posix() for f in files}
    for f in files:
        assert store.repos["me/moods"][f.relative_to(adapter).as_posix()] == f.read_bytes()
    capsys.readouterr()
    assert main(["push", str(adapter), "--repo-id", "me/moods", "--endpoint", "http://127.0.0.1:9",
                 "--token", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "me/moods" in err


@pytest.mark.parametrize("excluded,says", [(["0", "1"], "exclude_clients: [0, 1] leaves none of this run's 2 clients"),
                                           (["2"], "exclude_clients: client 2 is outside this run's 2 clients")])
def test_run_that_excludes_every_client_is_refused_before_anything_is_written(tiny_config, tmp_path, capsys,
                                                                              excluded, says):
    """Once it started, wrote the run folder and failed in round 1 with "no client replied"."""
    out = tmp_path / "excluded"
    argv = ["run", "--tasks", *tiny_config.tasks, "--base-model", tiny_config.base_model, "--num-clients", "2",
            "--rounds", "1", "--local-steps", "1", "--exclude-clients", *excluded, "--output-dir", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-fedtask: error: flags: ") and says in err[0]
    assert not out.exists()


def test_inspect_of_a_corrupt_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.safetensors" in err


def test_suite_export_writes_loadable_datasets(tmp_path, capsys):
    from datasets import load_from_disk

    assert main(["suite", "export", "builtin-8", str(tmp_path / "b8")]) == 0
    index = json.loads((tmp_path / "b8" / "suite.json").read_text())
    names = [t["name"] for t in index["tasks"]] if isinstance(index["tasks"], list) else list(index["tasks"])
    assert len(names) == 8
    ds = load_from_disk(str(tmp_path / "b8" / names[0]))
    assert set(ds) == {"train", "test"} and (tmp_path / "b8" / names[0] / "README.md").exists()


def test_load_adapter_example_predicts_label_names(tiny_config, capsys):
    import importlib.util

    run_dir = _run_tiny(tiny_config, capsys)
    adapter = run_dir / "adapters" / "colors"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = tiny_config.base_model  # the tiny base is local, not on the Hub
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    spec = importlib.util.spec_from_file_location("load_adapter",
                                                  Path(__file__).parents[1] / "examples" / "load_adapter.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    labels = example.main(str(adapter), ["red apple", "blue sky"])
    assert len(labels) == 2 and set(labels) <= {"red", "blue", "green"}


def test_flower_app_writes_the_manifest_and_a_bad_connection_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("flwr")
    import tomllib

    repo_app = Path(__file__).resolve().parents[1] / "flower-app" / "pyproject.toml"
    assert main(["flower", "app", str(tmp_path / "app")]) == 0
    assert tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text()) == tomllib.loads(repo_app.read_text())
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    capsys.readouterr()
    assert main(["flower", "run", "--connection", "nowhere", "--output-dir", str(tmp_path / "run"),
                 "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hf-fedtask: error") and "nowhere" in err[-1]
    assert not (tmp_path / "run").exists()
    assert main(["flower", "run", "--connection", "x", "--strategy", "fedavg", "--kappa", "2"]) == 2
    assert "'fedavg' does not support option 'kappa'" in capsys.readouterr().err


def test_export_of_a_finished_run_whose_datasets_are_gone(tiny_config, tiny_tasks_dir, tmp_path):
    """`hf-fedtask export RUN` needs the run folder and the base model only."""
    import shutil

    from safetensors.torch import load_file

    from hf_fedtask.engine.run import run

    data = tmp_path / "data"
    tiny_config.tasks = [shutil.copytree(p, data / Path(p).name) for p in tiny_tasks_dir]
    tiny_config.tasks = [str(p) for p in tiny_config.tasks]
    tiny_config.strategy = "matu"
    run(tiny_config)
    out = Path(tiny_config.output_dir)
    before = {p.relative_to(out): load_file(p) for p in out.rglob("adapter_model.safetensors")}
    shutil.rmtree(out / "adapters")
    shutil.rmtree(data)
    assert main(["export", str(out)]) == 0
    after = {p.relative_to(out): load_file(p) for p in out.rglob("adapter_model.safetensors")}
    assert after.keys() == before.keys() and len(after) >= 2
    for name, tensors in before.items():
        assert tensors.keys() == after[name].keys() and all((tensors[k] == after[name][k]).all() for k in tensors)


def test_run_says_what_was_asked_for_at_the_start_and_the_privacy_spent_at_the_end(tiny_config, capsys):
    """A DP run used to print no σ or ε (only results.json had them): the start names the strategy, clients,
    model, device, precision, processes, threads and the DP settings, before anything is written; the end
    gives ε at δ as results.json records it."""
    c = tiny_config
    argv = ["run", "--tasks", *c.tasks, "--base-model", c.base_model, "--base-model-id", c.base_model_id,
            "--num-clients", "4", "--participation", "0.5", "--rounds", "1", "--batch-size", "8", "--local-steps",
            "1", "--max-length", "16", "--min-samples", "4", "--output-dir", c.output_dir, "--threads", "1",
            "--dp-clip", "1", "--dp-noise-multiplier", "1.5", "--dp-noise-seed", "0", "--no-export"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"run: fedavg on 2 tasks, 4 clients, 2 per round (participation 0.5), 1 rounds -> {c.output_dir}"
    assert out[1].startswith(f"model: {c.base_model} (lora r = 8); device cpu; precision fp32; 1 process; "
                             "torch threads 1 (--threads)")
    assert out[2].startswith("privacy: client-level DP, clip C = 1, noise multiplier sigma = 1.5 (epsilon = ")
    assert out[2].endswith("delta = 1e-05, noise drawn on the server; noise seed given: reproducible, not private")
    privacy = json.loads((Path(c.output_dir) / "results.json").read_text())["privacy"]
    assert out[-1] == (f"privacy spent: epsilon = {privacy['epsilon']:.3g} at delta = 1e-05 after 1 rounds "
                       "(client-level; sigma = 1.5, clip C = 1)")
    assert f"(epsilon = {privacy['epsilon']:.3g} after 1 rounds)" in out[2]  # the start's estimate is what was spent


def test_a_refused_run_prints_no_settings(tiny_config, capsys):
    """The settings are printed once every check passed: a refusal that needs the model stays one error line on
    stderr (after transformers' own weight-loading bar), nothing on stdout."""
    c = tiny_config
    argv = ["run", "--tasks", *c.tasks, "--base-model", c.base_model, "--num-clients", "4", "--rounds", "1",
            "--output-dir", c.output_dir, "--strategy", "fedyolo", "--secure-aggregation", "--participation", "0.25"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert captured.out == "" and len(errors) == 1 and captured.err.strip().splitlines()[-1] == errors[0]
    assert "secure_aggregation needs at least 2 clients per round" in errors[0]
    assert not Path(c.output_dir).exists()
