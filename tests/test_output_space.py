"""A shared output space (`output_space: max | union`): one classification head for all tasks, inside
the shared PEFT state for every strategy, each task evaluated and exported with its own rows of it."""

import json

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL_ID

from hf_fedtask.config import RunConfig
from hf_fedtask.core.state import SHARED, head_name, matu_task_vector_name
from hf_fedtask.data.task import TaskInfo
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError
from hf_fedtask.model.output_space import OutputSpace
from hf_fedtask.strategies import STRATEGIES

TASKS = [TaskInfo("colors", ("red", "blue", "green")), TaskInfo("moods", ("happy", "sad"))]


def test_layouts_of_max_and_union():
    union = OutputSpace.build("union", TASKS)
    assert union.rows == {"colors": (0, 3), "moods": (3, 5)} and union.width == 5
    assert union.labels == ("colors:red", "colors:blue", "colors:green", "moods:happy", "moods:sad")
    wide = OutputSpace.build("max", TASKS)
    assert wide.rows == {"colors": (0, 3), "moods": (0, 2)} and wide.labels == ("happy/red", "blue/sad", "green")
    assert OutputSpace.build("per_task", TASKS).width == 0 and not OutputSpace.build("per_task", TASKS).shared
    head = {"h.weight": torch.arange(10.0).reshape(5, 2), "h.bias": torch.arange(5.0), "lora": torch.ones(2)}
    from hf_fedtask.core.taskvector import TaskVector
    view = union.task_view(TaskVector(head), "moods", ["h.weight", "h.bias"])
    assert torch.equal(view["h.bias"], torch.tensor([3.0, 4.0])) and torch.equal(view["lora"], torch.ones(2))
    assert "moods" in union.describe("moods") and "outputs 3-4" in union.describe("moods")
    with pytest.raises(ConfigError, match="output_space: must be one of"):
        RunConfig(output_space="shared")


def test_union_moves_training_labels_to_the_task_rows_and_keeps_test_labels(tiny_config):
    env = Environment(tiny_config.for_strategy("fedavg", output_space="union", zeta=0.5))
    rows = env.output_space.rows
    for cid in range(env.num_clients):
        for task, data in env.client_data(cid).items():
            labels = set(data["labels"])
            assert labels and all(rows[task][0] <= y < rows[task][1] for y in labels), (cid, task, labels)
    for task in env.task_by_name:
        assert set(env.test_data(task)["labels"]) == set(range(env.task_by_name[task].num_labels))
    state = env.initial
    assert state.vectors[SHARED]["base_model.model.classifier.weight"].shape[0] == 5
    assert all(len(state.vectors[head_name(t)]) == 0 for t in env.task_by_name)  # no per-task heads


@pytest.mark.parametrize("strategy", sorted(set(STRATEGIES) - {"tct"}))
def test_every_strategy_trains_the_shared_head(tiny_config, strategy, tmp_path):
    """One round under `union`: the head (5 outputs) is in the shared state and moved."""
    extra = {"tasks": tiny_config.tasks[:1], "participation": 1.0} if strategy == "f2l2" else {"zeta": 0.5}
    if strategy == "scaffold":
        extra["optimizer"] = "sgd"
    config = tiny_config.for_strategy(strategy, output_space="union", rounds=2, export=False,
                                      output_dir=str(tmp_path / "run"), **extra)
    results = run(config)
    assert set(results["tasks"]) == {t.name for t in Environment(config).tasks}
    from hf_fedtask.engine.run_folder import open_finished_run
    finished = open_finished_run(tmp_path / "run")
    vectors = finished.state.vectors
    head_key = "base_model.model.classifier.weight"
    holders = [name for name, v in vectors.items() if head_key in v]
    assert holders, "no vector carries the shared head"
    initial = finished.env.initial.vectors
    assert any(not torch.equal(vectors[n][head_key], initial[n][head_key]) for n in holders if n in initial) or \
        strategy in ("fedper",)  # FedPer's head is personal: it stays on the clients
    width = finished.env.output_space.width
    factors = [n for n in holders if n.startswith("curvature/")]  # F²L²'s curvature factors: rank rows over it
    assert all(vectors[n][head_key].shape[0] == width for n in holders if n not in factors)
    assert all(vectors[n][head_key].shape[1] == width for n in factors)
    assert bool(factors) == (strategy == "f2l2")  # the server's factor of H_s, kept from the gradient round


def test_tct_refuses_a_shared_output_space(tiny_config):
    config = tiny_config.for_strategy("tct", output_space="max", participation=1.0, rounds=4)
    with pytest.raises(ConfigError, match="does not support output_space 'max'"):
        run(config)


def test_individual_centralized_refuses_a_shared_output_space(tiny_config):
    from hf_fedtask.workflows.reference import individual_centralized

    with pytest.raises(ConfigError, match="output_space 'union' does not apply"):
        individual_centralized([], tiny_config.for_strategy("fedavg", output_space="union"))


def test_fedavg_sends_every_client_the_same_head(tiny_config):
    env = Environment(tiny_config.for_strategy("fedavg", output_space="max", zeta=0.0))
    state, head_key = env.initial, "base_model.model.classifier.weight"
    heads = [env.strategy.downlink(state, c, tasks)[SHARED][head_key] for c, tasks in env.allocation.items()]
    assert len({tuple(t) for tasks in env.allocation.values() for t in [tasks]}) == 2  # clients of both tasks
    assert all(torch.equal(h, heads[0]) for h in heads) and heads[0].shape[0] == 3


def test_matu_masks_and_rescales_the_head_inside_its_task_vectors(tiny_config, tmp_path):
    from hf_fedtask.export.compact import load_task_adapter, task_state

    config = tiny_config.for_strategy("matu", output_space="union", zeta=0.5, rounds=2,
                                      output_dir=str(tmp_path / "run"))
    results = run(config)
    from hf_fedtask.engine.run_folder import open_finished_run
    finished = open_finished_run(tmp_path / "run")
    head_key = "base_model.model.classifier.weight"
    for task in ("colors", "moods"):
        tau = finished.state.vectors[matu_task_vector_name(task)]
        assert head_key in tau and tau[head_key].abs().sum() > 0  # the head moved inside τ^t
        compact = task_state(tmp_path / "run" / "compact", task)
        expected = finished.env.task_view(finished.env.strategy.compact_task_parameters(finished.state, task), task)
        assert compact.keys() == expected.keys()
        assert all(torch.allclose(compact[k], expected[k]) for k in compact), task
        model = load_task_adapter(tmp_path / "run" / "compact", task, base_model=tiny_config.base_model)
        assert model.config.num_labels == results["tasks"][task]["num_labels"]
    info = json.loads((tmp_path / "run" / "compact" / "tasks.json").read_text())
    assert [t["head_rows"] for t in info["tasks"]] == [[0, 3], [3, 5]] and info["head_keys"]


def test_exported_adapters_are_the_tasks_own_classifiers_with_stock_peft(tiny_config, tiny_tasks_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification, pipeline

    from hf_fedtask.data import load_task

    config = tiny_config.for_strategy("fedavg", output_space="union", rounds=2, output_dir=str(tmp_path / "run"))
    results = run(config)
    for path in tiny_tasks_dir:
        task = load_task(path)
        r, adapter = results["tasks"][task.name], tmp_path / "run" / "adapters" / task.name
        assert "shared by all 2 tasks" in (adapter / "README.md").read_text()
        labelled = AutoConfig.from_pretrained(adapter, subfolder="classifier")
        assert labelled.num_labels == task.num_labels
        base = AutoModelForSequenceClassification.from_pretrained(config.base_model, config=labelled)
        model = PeftModel.from_pretrained(base, adapter).eval()
        classify = pipeline("text-classification", model=model, tokenizer=str(adapter), top_k=1)
        test = task.dataset["test"]
        predicted = [out[0]["label"] for out in classify(list(test["text"]))]
        accuracy = float(np.mean([p == task.label_names[y] for p, y in zip(predicted, test["label"])]))
        assert accuracy == pytest.approx(r["accuracy"], abs=1e-9), task.name
    assert TINY_MODEL_ID in (tmp_path / "run" / "adapters" / "moods" / "adapter_config.json").read_text()


def test_a_shared_head_learns_real_tasks_above_chance(tmp_path):
    """MiniLM, two builtin tasks sharing one `max` head (2 outputs, each task's labels on both).
    Measured: 0.82 / 0.76 after 2 rounds (per-task heads: 0.905 / 0.761; `union`, 4 outputs, learns
    slower: 0.50 / 0.68 after 2 rounds, 0.825 / 0.58 after 4)."""
    config = RunConfig(strategy="fedavg", suite=None, tasks=["vader_polarity", "first_name_gender"],
                       output_space="max", num_clients=2, rounds=2, export=False, output_dir=str(tmp_path / "run"))
    results = run(config)
    for name, r in results["tasks"].items():
        assert r["accuracy"] >= r["chance"] + 0.1, (name, r["accuracy"], r["chance"])
