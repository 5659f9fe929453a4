"""The MaTU tables' baselines: FedPer (personal layers stay on clients; a task's metric is the mean over its
holders' own models) and the MaT-FL-style grouped aggregation (a client moves by its nearest peers' mean update)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_config, tensors_equal
from safetensors.torch import load_file

from hf_fedtask.client.evaluation import evaluate
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.engine import run as federation
from hf_fedtask.errors import ConfigError
from hf_fedtask.strategies import ClientJob, build_strategy
from hf_fedtask.strategies.base import SHARED, head_name
from hf_fedtask.strategies.fedper import PERSONAL, last_block_keys
from hf_fedtask.strategies.matfl import model_name


def test_last_block_keys_picks_the_highest_numbered_blocks():
    keys = [f"base.encoder.layer.{i}.attention.query.lora_A.weight" for i in range(12)] + ["base.pooler.lora_A.weight"]
    assert last_block_keys(keys, 1) == [keys[11]]
    assert last_block_keys(keys, 2) == keys[10:12]
    with pytest.raises(ConfigError, match="numbered transformer blocks"):
        last_block_keys(["prompt_embeddings"], 1)


def test_fedper_personal_layers_and_heads_never_travel_and_survive_resume(tiny_config):
    tiny_config.strategy = "fedper"
    tiny_config.save_payloads = True
    tiny_config.rounds = 1
    federation.run(tiny_config)
    sim = federation.Federation(tiny_config)
    personal = set(last_block_keys(sim.host.shared_keys, 1))
    payloads = sorted((Path(tiny_config.output_dir) / "payloads" / "round_1").glob("*.safetensors"))
    assert payloads
    for path in payloads:
        keys = [k.partition("::")[2] for k in load_file(path)]
        assert not personal & set(keys) and not any(k in sim.host.head_keys for k in keys), path.name
    tiny_config.rounds = 2
    federation.run(tiny_config, resume=True)  # the stores come back from the checkpoint
    from hf_fedtask.core.checkpoint import load_checkpoint

    state, _, stores = load_checkpoint(Path(tiny_config.output_dir), fingerprint=tiny_config.fingerprint(),
                                       template=sim.initial_state())
    assert state.round == 2 and set(stores) == set(range(4))
    for cid, store in stores.items():
        assert set(store[PERSONAL]) == personal
        assert {head_name(t) for t in state.allocation[cid]} <= set(store)
        # each client's personal layers moved away from the seeded init, on its own
        assert (store[PERSONAL] - sim.origin.filter(lambda k: k in personal)).norm() > 0


def test_fedper_metric_is_the_mean_over_the_holders_own_models(tiny_bert_dir, tiny_tasks_dir, tmp_path,
                                                               monkeypatch):
    """Each task's logged metric is the mean over its holders of evaluating their own model
    (`client_task_parameters`: global modules, personal layers, own head) as computed by hand; the
    engine evaluated exactly those models, on each holder; `clients` counts the holders."""
    from hf_fedtask.engine.client import ClientRuntime

    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", strategy="fedper", zeta=0.5, local_steps=2)
    fed = federation.Federation(config)
    strategy = fed.strategy
    evaluated = {}  # (client, task) -> the parameters the engine's client evaluated
    original = ClientRuntime._evaluate

    def spy(self, params, task):
        evaluated[(self.client_id, task)] = params
        return original(self, params, task)

    monkeypatch.setattr(ClientRuntime, "_evaluate", spy)
    state, record = fed.run_round(fed.initial_state(), 1)
    assert sorted(evaluated) == sorted((c, t) for c, tasks in state.allocation.items() for t in tasks)
    for task in fed.env.task_by_name.values():
        holders = state.holders(task.name)
        values, params = [], []
        for c in holders:
            job = ClientJob(client_id=c, round=state.round, data=fed.client_data(c), seed=config.seed,
                            origin=fed.origin, initial_heads=fed.initial_heads, store=fed.client_stores[c])
            params.append(strategy.client_task_parameters(strategy.downlink(state, c, state.allocation[c]), job,
                                                          task.name))
            values.append(evaluate(fed.host, params[-1], fed.test_data(task.name), task.metric,
                                   config.eval_batch_size)[task.metric])
            assert tensors_equal(dict(evaluated[(c, task.name)]), dict(params[-1])), (c, task.name)
        entry = record["eval"][task.name]
        assert entry["clients"] == len(holders) >= 2
        assert entry[task.metric] == pytest.approx(float(np.mean(values)), abs=1e-12)
        assert (params[0] - params[1]).norm() > 0  # the holders' models are their own


def test_matfl_moves_each_client_by_its_groups_mean_update():
    strategy = build_strategy("matfl", {"group_size": 2})
    init = TaskVector({"w": torch.zeros(3)})
    host = SimpleNamespace(initial_shared=lambda: init,
                           initial_head=lambda n, seed: TaskVector({"h": torch.zeros(2)}))
    state = strategy.init_state(host, [SimpleNamespace(name="a", num_labels=2)], 0, {0: ["a"], 1: ["a"], 2: ["a"]})
    deltas = [torch.tensor([1.0, 0, 0]), torch.tensor([0.9, 0.1, 0.2]), torch.tensor([0, 0, 1.0])]
    samples = [10, 30, 20]
    updates = [ClientUpdate(c, 1, {SHARED: TaskVector({"w": d}), head_name("a"): TaskVector({"h": torch.zeros(2)})},
                            {"a": n}) for c, (d, n) in enumerate(zip(deltas, samples))]
    new = strategy.server_aggregate(state, updates)
    pair = (10 * deltas[0] + 30 * deltas[1]) / 40  # clients 0 and 1 are each other's nearest peer
    torch.testing.assert_close(new.vectors[model_name(0)]["w"], pair)
    torch.testing.assert_close(new.vectors[model_name(1)]["w"], pair)
    nearest_to_2 = (20 * deltas[2] + 30 * deltas[1]) / 50  # cos(2,1) > cos(2,0) = 0
    torch.testing.assert_close(new.vectors[model_name(2)]["w"], nearest_to_2)


@pytest.mark.parametrize("strategy", ["fedper", "matfl"])
def test_baseline_runs_end_to_end_with_partial_participation(tiny_config, strategy):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    tiny_config.strategy = strategy
    tiny_config.participation = 0.5
    tiny_config.zeta = 0.5
    results = federation.run(tiny_config)
    assert results["strategy"] == strategy and results["rounds"] == 2
    base = AutoModelForSequenceClassification.from_pretrained(tiny_config.base_model, num_labels=3)
    PeftModel.from_pretrained(base, Path(tiny_config.output_dir) / "adapters" / "colors")
