"""Personal models: every client fine-tunes a task's model on its own data, and the task is scored by
the mean metric of its holders' models on the task's test split. FedYolo's paper uses two baselines
that are this one procedure from two starting points:

- FedAvg+Local (`personalize`): start from a finished federated run's model of each task and
  fine-tune for E epochs; report the metric before, the holders' mean after and the forgetting
  ratio (Acc_FedAvg − Acc_FedAvg+Local) / Acc_FedAvg.
- Local-only (`local_only`): start from the seeded initial modules and heads and train for the run's
  whole budget (rounds × local epochs or steps). Nothing is serialized or sent: 0 bytes.

One model in memory: each personal model is trained, scored and dropped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from hf_fedtask.client.evaluation import evaluate
from hf_fedtask.client.trainer import LocalTrainer
from hf_fedtask.config import RunConfig
from hf_fedtask.core.state import ClientStore, GlobalState
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.run_folder import open_finished_run
from hf_fedtask.engine.server import Server
from hf_fedtask.errors import ConfigError
from hf_fedtask.strategies import ClientJob


def forgetting_ratio(before: float, after: float) -> float | None:
    """(before − after) / before: the share of the global model's metric lost by personalizing
    (negative when personalizing helps); None when `before` is 0."""
    return (before - after) / before if before else None


def fine_tune_locally(env: Environment, state: GlobalState, *, local_epochs: float = 1.0, local_steps: int = -1,
                      stores: dict[int, ClientStore] | None = None) -> dict[str, list[float]]:
    """Task -> the metric of each holder's model, fine-tuned from `state`'s model of the task on the
    holder's own data for `local_epochs` (or `local_steps` optimizer steps when > 0)."""
    args = dataclasses.replace(env.trainer.args, local_epochs=local_epochs, local_steps=local_steps)
    trainer = LocalTrainer(env.host, args)
    scores: dict[str, list[float]] = {t.name: [] for t in env.tasks}
    for cid in range(env.num_clients):
        data = env.client_data(cid)
        job = ClientJob(client_id=cid, round=state.round + 1, data=data, seed=env.config.local_training_seed)
        for name in job.tasks:
            start = env.strategy.task_parameters(state, name, stores)
            trained, _ = trainer.train(start, data[name], seed=job.seed_for(name))
            metric = env.task_by_name[name].metric
            scores[name].append(evaluate(env.host, env.task_view(trained, name), env.test_data(name), metric,
                                         env.config.eval_batch_size)[metric])
    return scores


def personalize(run: str | Path | tuple[Environment, GlobalState], epochs: float = 1.0) -> dict:
    """FedAvg+Local: per task, `before` (the federated model's metric), `after` (the mean over the
    task's holders of their fine-tuned models' metric), `forgetting_ratio` and `clients`. `run` is a
    finished run's folder, or an (environment, final state) pair."""
    if isinstance(run, tuple):
        (env, state), stores = run, None
    else:
        finished = open_finished_run(run)
        env, state, stores = finished.env, finished.state, finished.stores
    if not env.strategy.capabilities.personalization or env.strategy.capabilities.client_evaluation:
        raise ConfigError(f"strategy {env.strategy.name!r}: its task models are personal already; "
                          "FedAvg+Local starts from one model per task")
    before = Server(env).evaluate(state, stores=stores)
    after = fine_tune_locally(env, state, local_epochs=epochs, stores=stores)
    out = {}
    for t in env.tasks:
        b, a = before[t.name][t.metric], float(np.mean(after[t.name]))
        out[t.name] = {"metric": t.metric, "before": b, "after": a, "forgetting_ratio": forgetting_ratio(b, a),
                       "clients": len(after[t.name])}
    return out


def local_only(run: Environment | RunConfig) -> dict:
    """Local-only: per task, the mean over its holders (`per_client`) of the metric of a model each
    trained alone from the initial state with the run's budget (`rounds` × `local_steps` steps when
    set, else `rounds` × `local_epochs` epochs)."""
    env = run if isinstance(run, Environment) else Environment(run)
    c = env.config
    budget = ({"local_steps": c.rounds * c.local_steps} if c.local_steps > 0
              else {"local_epochs": c.rounds * c.local_epochs})
    scores = fine_tune_locally(env, env.initial_state(), **budget)
    return {t.name: {"metric": t.metric, t.metric: float(np.mean(scores[t.name])), "per_client": scores[t.name]}
            for t in env.tasks}
