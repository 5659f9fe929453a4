"""`eval_every`: evaluating every k rounds (always after the last) changes no training result."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_fedtask.config import RunConfig
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError


def _history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sparse_evaluation_trains_identically_and_reports_the_last_round(tiny_config, tmp_path):
    every = dataclasses.replace(tiny_config, rounds=4, output_dir=str(tmp_path / "every"))
    sparse = dataclasses.replace(every, eval_every=3, output_dir=str(tmp_path / "sparse"))
    dense_results, sparse_results = run(every), run(sparse)
    dense_state = load_file(str(tmp_path / "every" / "checkpoint.safetensors"))
    sparse_state = load_file(str(tmp_path / "sparse" / "checkpoint.safetensors"))
    assert dense_state.keys() == sparse_state.keys()
    assert all(torch.equal(dense_state[k], sparse_state[k]) for k in dense_state)
    history = _history(tmp_path / "sparse")
    assert [h["round"] for h in history] == [1, 2, 3, 4]
    assert ["eval" in h for h in history] == [False, False, True, True]  # every 3rd, and the last
    assert all("mean_metric" not in h and h["bytes_uplink"] > 0 for h in history[:2])
    dense = _history(tmp_path / "every")
    assert [history[i]["eval"] for i in (2, 3)] == [dense[i]["eval"] for i in (2, 3)]
    assert (sparse_results["tasks"] == dense_results["tasks"]
            and sparse_results["mean_metric"] == dense_results["mean_metric"])
    assert (tmp_path / "sparse" / "accuracy_vs_round.png").stat().st_size > 0


def test_eval_every_is_validated_and_may_change_on_resume():
    with pytest.raises(ConfigError, match="eval_every: must be >= 1, got 0"):
        RunConfig(suite="builtin-8", eval_every=0)
    with pytest.raises(ConfigError, match="eval_every"):
        RunConfig.from_dict({"suite": "builtin-8", "eval_every": "often"})
    assert RunConfig(suite="builtin-8", eval_every=5).same_run(RunConfig(suite="builtin-8"))


def test_unlearning_starts_at_an_unevaluated_round(tiny_config):
    config = dataclasses.replace(tiny_config, rounds=3, eval_every=2, export=False,
                                 strategy_options={"forget_tasks": ["colors"]})
    results = run(config)
    history = _history(Path(config.output_dir))
    assert "eval" not in history[0] and history[0]["forgotten_tasks"] == ["colors"]
    unlearning = results["unlearning"]
    assert unlearning["from_round"] == 1 and unlearning["rounds"] == 3 and unlearning["before"] is None
    assert unlearning["after"] == history[-1]["eval"]
    assert history[1]["forgotten"] == {"colors": history[1]["eval"]["colors"]["accuracy"]}
    assert (Path(config.output_dir) / "unlearning.png").stat().st_size > 0
