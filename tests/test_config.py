"""RunConfig: YAML, flag overrides, validation, fingerprint."""

import argparse

import pytest

from hf_fedtask.config import RunConfig, add_config_arguments, config_from_args
from hf_fedtask.errors import ConfigError


def _parse(argv):
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_flags_override_yaml(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("strategy: fedprox\nrounds: 7\nproximal_mu: 0.5\nreport_to: [tensorboard]\n")
    c = _parse(["--config", str(cfg), "--rounds", "2", "--learning-rate", "0.1", "--no-export"])
    assert (c.strategy, c.rounds, c.strategy_config.proximal_mu, c.learning_rate, c.export) == ("fedprox", 2, 0.5, 0.1, False)
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
                                         ("tasks", "colors")])
def test_bad_values_are_rejected(field, value):
    with pytest.raises(ConfigError, match=field):
        RunConfig(**{field: value})


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
    argv = ["--strategy", strategy, flag] + ([] if value is True else [str(v) for v in (value if isinstance(value, list) else [value])])
    with pytest.raises(ConfigError, match=f"'{strategy}' does not support option '{option}'"):
        _parse(argv)
    cfg = tmp_path / "run.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump({"strategy": strategy, option: value}))
    with pytest.raises(ConfigError, match=f"'{strategy}' does not support option '{option}'"):
        _parse(["--config", str(cfg)])
    with pytest.raises(ConfigError, match=f"'{strategy}' does not support option '{option}'"):
        RunConfig(strategy=strategy, strategy_options={option: value})
