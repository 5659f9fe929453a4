"""RunConfig: YAML, flag overrides, validation, fingerprint."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from hf_fedtask.config import RunConfig, add_config_arguments, config_from_args
from hf_fedtask.data import SUITES
from hf_fedtask.errors import ConfigError


def _parse(argv):
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_flags_override_yaml(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("strategy: fedprox\nrounds: 7\nproximal_mu: 0.5\nreport_to: [tensorboard]\n")
    c = _parse(["--config", str(cfg), "--rounds", "2", "--learning-rate", "0.1", "--no-export"])
    assert (c.strategy, c.rounds, c.strategy_config.proximal_mu, c.learning_rate, c.export) == (
        "fedprox", 2, 0.5, 0.1, False)
    assert c.report_to == ["tensorboard"]


def test_tasks_flag_replaces_suite():
    c = _parse(["--tasks", "a", "b"])
    assert c.tasks == ["a", "b"] and c.suite is None


def test_unknown_yaml_key_names_the_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("roundz: 3\n")
    with pytest.raises(ConfigError, match="roundz"):
        _parse(["--config", str(cfg)])


@pytest.mark.parametrize("field,value", [("participation", 0.0), ("rounds", 0), ("zeta", -1.0), ("num_clients", 0),
                                         ("rounds", "three"), ("participation", "half"), ("export", "yes"),
                                         ("tasks", "colors"), ("alpha", 0.0), ("lora_dropout", 1.5),
                                         ("max_train_samples", 0), ("backdoor_client", -2), ("exclude_clients", [-1]),
                                         ("peft_method", "loha"), ("lr_scheduler", "cosine_with_min_lr"),
                                         ("optimizer", "adam"), ("suite", "builtin-9"), ("output_space", "shared")])
def test_bad_values_are_rejected(field, value):
    with pytest.raises(ConfigError, match=field):
        RunConfig(**{field: value})


def test_a_choice_is_checked_on_construction_in_one_line_naming_the_value_and_the_choices(tmp_path):
    """`partition` was once checked only when the data were partitioned (a DataError mid-run)."""
    for build in (lambda: RunConfig(partition="niid"), lambda: _parse(["--partition", "niid"])):
        with pytest.raises(ConfigError) as e:
            build()
        message = str(e.value)
        assert len(message.splitlines()) == 1
        assert "partition" in message and "'niid'" in message and "iid, dirichlet, classes" in message
    assert str(e.value) == "flags: partition: must be one of iid, dirichlet, classes, got 'niid'"


def test_every_run_flag_has_help_and_shows_what_it_accepts():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert {f.name for f in dataclasses.fields(RunConfig)} - {"strategy_options"} <= set(flags)
    assert [name for name, a in flags.items() if not a.help] == []
    assert "{iid, dirichlet, classes}" in flags["partition"].help
    assert "(in (0.0, 1.0])" in flags["participation"].help and "(>= 1)" in flags["rounds"].help


def test_the_named_choices_are_transformers_names():
    from transformers import SchedulerType
    from transformers.training_args import OptimizerNames

    from hf_fedtask.config import LR_SCHEDULERS, OPTIMIZERS

    assert set(LR_SCHEDULERS) <= {s.value for s in SchedulerType}
    assert set(OPTIMIZERS) <= {o.value for o in OptimizerNames}


@pytest.mark.parametrize("settings,message", [
    (dict(tasks=["a", "b"], exclude_clients=[0, 1]), "exclude_clients: [0, 1] leaves none of this run's 2 clients"),
    (dict(num_clients=3, exclude_clients=[2, 0, 1]), "exclude_clients: [2, 0, 1] leaves none of this run's 3 clients"),
    (dict(tasks=["a", "b"], exclude_clients=[2]), "exclude_clients: client 2 is outside this run's 2 clients"),
    (dict(num_clients=4, backdoor_client=4), "backdoor_client: client 4 is outside this run's 4 clients"),
])
def test_client_ids_are_checked_against_the_runs_clients_on_construction(settings, message):
    with pytest.raises(ConfigError) as e:
        RunConfig(**settings)
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1
    assert RunConfig(**{**settings, "exclude_clients": [0], "backdoor_client": 1}).client_count >= 2


def test_client_count_is_num_clients_else_one_per_task():
    assert RunConfig().client_count == len(SUITES["builtin-8"]) == 8
    assert RunConfig(tasks=["a", "b", "c"]).client_count == 3
    assert RunConfig(tasks=["a", "b", "c"], num_clients=5).client_count == 5


def test_local_training_args_are_the_run_configs_settings_under_their_names():
    """One name per setting: LocalTrainingArgs repeats neither RunConfig's names' translations nor its defaults."""
    from hf_fedtask.client.trainer import LocalTrainingArgs

    fields = dataclasses.fields(LocalTrainingArgs)
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)
    assert {f.name for f in fields} <= {f.name for f in dataclasses.fields(RunConfig)}
    config = RunConfig(local_epochs=2.5, local_steps=7, optimizer="sgd", lr_scheduler="constant", batch_size=4,
                       mixed_precision="bf16")
    args = LocalTrainingArgs.from_run(config)
    assert all(getattr(args, f.name) == getattr(config, f.name) for f in fields)
    assert (args.local_epochs, args.local_steps, args.optimizer) == (2.5, 7, "sgd")


@pytest.mark.parametrize(
    "preset", sorted(p.name for p in (Path(__file__).parents[1] / "recipes" / "presets").glob("*.yaml")))
def test_presets_load_through_flags_as_they_do_through_yaml(preset, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    path = Path(__file__).parents[1] / "recipes" / "presets" / preset
    assert _parse(["--config", str(path)]) == RunConfig.from_yaml(path)


def test_fingerprint_ignores_where_and_how_long_but_not_what():
    a = RunConfig()
    assert a.fingerprint() == RunConfig(output_dir="elsewhere", rounds=50).fingerprint()
    assert a.fingerprint() != RunConfig(learning_rate=0.1).fingerprint()


def test_a_setting_added_later_at_its_default_keeps_old_runs_resumable():
    """Runs saved by a release without `wire_dtype` are the same run for a release with it."""
    config = RunConfig(strategy="matu", learning_rate=0.01)
    saved = {k: v for k, v in config.flat().items() if k != "wire_dtype"}
    assert RunConfig.from_dict(saved).fingerprint() == config.fingerprint()
    assert RunConfig.from_dict({**saved, "wire_dtype": "bfloat16"}).fingerprint() != config.fingerprint()


def test_a_flat_run_config_of_the_previous_release_still_loads_and_keeps_its_fingerprint(tmp_path):
    """Earlier releases wrote every strategy's option as a flat key; other strategies' defaults are dropped."""
    import yaml

    legacy = {**RunConfig().common(), "strategy": "matu", "kappa": 3, "server_lr": 1.0, "proximal_mu": 0.01,
              "forget_tasks": None, "track_task_vectors": False, "linearize_at": "server", "share": "none",
              "secure_aggregation": False, "personal_blocks": 1, "group_size": 3}
    path = tmp_path / "run_config.yaml"
    path.write_text(yaml.safe_dump(legacy))
    config = RunConfig.from_yaml(path, saved=True)
    assert config.strategy_config.kappa == 3
    assert config.fingerprint() == RunConfig.from_dict({"strategy": "matu", "kappa": 3}).fingerprint()
    with pytest.raises(ConfigError, match="'matu' does not support option"):
        RunConfig.from_yaml(path)  # a user's YAML gets no such leniency
    legacy["proximal_mu"] = 0.5  # set away from its default for a strategy that never read it: said, not dropped
    path.write_text(yaml.safe_dump(legacy))
    with pytest.raises(ConfigError, match="proximal_mu"):
        RunConfig.from_yaml(path, saved=True)


@pytest.mark.parametrize("strategy,option,value", [
    ("fedavg", "secure_aggregation", True), ("matu", "forget_tasks", ["x"]), ("matfl", "forget_tasks", ["x"]),
    ("fedavg", "proximal_mu", 0.1), ("fedavg", "share", "half"), ("matu", "linearize_at", "pretrained"),
    ("fedyolo", "kappa", 3), ("fedper", "track_task_vectors", True),
])
def test_an_option_the_strategy_does_not_have_is_an_error_from_flags_yaml_and_python(strategy, option, value, tmp_path):
    flag = "--" + option.replace("_", "-")
    argv = ["--strategy", strategy, flag] + ([] if value is True
                                             else [str(v) for v in (value if isinstance(value, list) else [value])])
    with pytest.raises(ConfigError, match=f"'{strategy}' does not support option '{option}'"):
        _parse(argv)
    cfg = tmp_path / "run.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump({"strategy": strategy, option: value}))
    with pytest.raises(ConfigError, match=f"'{strategy}' does not support option '{option}'"):
        _parse(["--config", str(cfg)])
    with pytest.raises(ConfigError, match=f"'{strategy}' does not support option '{option}'"):
        RunConfig(strategy=strategy, strategy_options={option: value})
