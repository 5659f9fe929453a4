"""A query round then training through the real engine: the QueryThenTrain strategy asks the clients for
label statistics in round 1, stores them under a new state vector, then trains; resume is exact."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import Crash, crash_after, make_config, read_records, tensors_equal
from safetensors.torch import load_file

from hf_fedtask.core.checkpoint import CHECKPOINT_FILE, load_checkpoint
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.engine.run import run
from hf_fedtask.engine.run_folder import open_finished_run
from hf_fedtask.errors import ConfigError, TaskVectorError
from hf_fedtask.strategies import (
    QUERY,
    STRATEGIES,
    TRAIN,
    Capabilities,
    FedAvg,
    FedAvgConfig,
    GlobalState,
    register_strategy,
)

STATS = "label_stats"


@dataclass
class QueryThenTrainConfig(FedAvgConfig):
    pass


class QueryThenTrain(FedAvg):
    """Round 1 asks every client for its sample count and label sum (no training); the server stores
    their sum under a new state vector `label_stats` and switches the phase to train (FedAvg)."""

    name = "test-query-then-train"
    config_class = QueryThenTrainConfig
    capabilities = Capabilities()

    @staticmethod
    def _stats_layout() -> TaskVector:
        return TaskVector({"count": torch.zeros(1, dtype=torch.int64), "label_sum": torch.zeros(1, dtype=torch.int64)})

    @staticmethod
    def _querying(state: GlobalState) -> bool:
        return state.scalars.get("phase") == "stats"

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        state.scalars["phase"] = "stats"
        return state

    def state_template(self, initial, scalars) -> GlobalState:
        if scalars.get("phase") == "stats":
            return initial
        return GlobalState(initial.round, {**initial.vectors, STATS: self._stats_layout()}, dict(scalars))

    def message_kind(self, state):
        return QUERY if self._querying(state) else TRAIN

    def query_name(self, state):
        return STATS if self._querying(state) else ""

    def downlink(self, state, client_id, tasks):
        return {} if self._querying(state) else super().downlink(state, client_id, tasks)

    def update_templates(self, state, client_id, tasks):
        return ({STATS: self._stats_layout()} if self._querying(state)
                else super().update_templates(state, client_id, tasks))

    def client_query(self, downlink, job, trainer) -> ClientUpdate:
        if job.query != STATS or downlink:
            raise ConfigError(f"unexpected query {job.query!r} with downlink {sorted(downlink)}")
        count = sum(len(d) for d in job.data.values())
        label_sum = sum(int(sum(d["labels"])) for d in job.data.values())
        stats = TaskVector({"count": torch.tensor([count]), "label_sum": torch.tensor([label_sum])})
        return ClientUpdate(job.client_id, job.round, {STATS: stats}, job.num_samples(), {})

    def server_aggregate(self, state, updates) -> GlobalState:
        if self._querying(state):
            return state.next({STATS: sum(u.vectors[STATS] for u in updates)}, phase="train")
        return super().server_aggregate(state, updates)


@pytest.fixture
def query_strategy():
    register_strategy(QueryThenTrain)
    yield QueryThenTrain
    STRATEGIES.pop(QueryThenTrain.name, None)


def test_query_round_then_training_changes_the_layout_and_resumes_exactly(query_strategy, tiny_bert_dir,
                                                                           tiny_tasks_dir, tmp_path):
    """Round 1 is a QUERY (logged `kind: query`, no training); its aggregate is stored under a new vector
    equal to the true sums over the clients' data; rounds 2-3 train; killed after round 2 and resumed
    (validated against the phase's layout) equals the uninterrupted run."""
    straight = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "straight", strategy=query_strategy.name, rounds=3)
    run(straight)
    killed = dataclasses.replace(straight, output_dir=str(tmp_path / "killed"))
    with pytest.raises(Crash):
        run(killed, callbacks=[crash_after(2)])
    run(killed, resume=True)

    a, b = (load_file(Path(c.output_dir) / CHECKPOINT_FILE) for c in (straight, killed))
    assert tensors_equal(a, b)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    records = read_records(Path(straight.output_dir))
    assert strip(records) == strip(read_records(Path(killed.output_dir)))
    assert [r.get("kind") for r in records] == ["query", None, None]
    assert records[0]["train_loss"] is None and records[1]["train_loss"] is not None
    assert records[0]["clients"] == [0, 1, 2, 3] and records[0]["params_downlink"] == 0  # a query sends nothing

    finished = open_finished_run(straight.output_dir)  # restored with the train phase's layout
    state, env = finished.state, finished.env
    assert state.round == 3 and state.scalars["phase"] == "train"
    data = [(env.partition[c][t], env.task_by_name[t].label_column) for c in range(env.num_clients)
            for t in env.allocation[c]]
    assert int(state.vectors[STATS]["count"]) == sum(len(d) for d, _ in data) == 96
    assert int(state.vectors[STATS]["label_sum"]) == sum(sum(d[col]) for d, col in data)
    assert torch.equal(a[f"{STATS}::label_sum"], state.vectors[STATS]["label_sum"])
    with pytest.raises(TaskVectorError, match=STATS):  # the layout did change: the phase-0 template refuses it
        load_checkpoint(Path(straight.output_dir), fingerprint=straight.fingerprint(), template=env.initial)
