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
    assert (c.strategy, c.rounds, c.proximal_mu, c.learning_rate, c.export) == ("fedprox", 2, 0.5, 0.1, False)
    assert c.report_to == ["tensorboard"]


def test_tasks_flag_replaces_suite():
    c = _parse(["--tasks", "a", "b"])
    assert c.tasks == ["a", "b"] and c.suite is None


def test_unknown_yaml_key_names_the_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("roundz: 3\n")
    with pytest.raises(ConfigError, match="roundz"):
        _parse(["--config", str(cfg)])


@pytest.mark.parametrize("field,value", [("participation", 0.0), ("rounds", 0), ("zeta", -1.0)])
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
    saved = {k: v for k, v in config.to_dict().items() if k != "wire_dtype"}
    assert RunConfig.from_dict(saved).fingerprint() == config.fingerprint()
    assert RunConfig.from_dict({**saved, "wire_dtype": "bfloat16"}).fingerprint() != config.fingerprint()
