"""Personal models: every client fine-tunes a task's model on its own data, and the task is scored by
the mean metric of its holders' models on the task's test split. FedYolo's paper (algorithms.md §4)
uses two baselines that are this one procedure from two starting points:

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

from hf_fedtask.client.trainer import LocalTrainer
from hf_fedtask.config import RunConfig
from hf_fedtask.client.evaluation import evaluate
from hf_fedtask.engine.run import Simulation, open_finished_run
from hf_fedtask.strategies import ClientJob, GlobalState


def forgetting_ratio(before: float, after: float) -> float | None:
    """(before − after) / before: the share of the global model's metric lost by personalizing
    (negative when personalizing helps); None when `before` is 0."""
    return (before - after) / before if before else None


def fine_tune_locally(sim: Simulation, state: GlobalState, *, epochs: float = 1.0,
                      max_steps: int = -1) -> dict[str, list[float]]:
    """Task -> the metric of each holder's model, fine-tuned from `state`'s model of the task on the
    holder's own data for `epochs` (or `max_steps` optimizer steps when > 0)."""
    args = dataclasses.replace(sim.trainer.args, epochs=epochs, max_steps=max_steps)
    trainer = LocalTrainer(sim.host, args)
    tasks = {t.name: t for t in sim.tasks}
    scores: dict[str, list[float]] = {name: [] for name in tasks}
    for cid, data in enumerate(sim.client_data):
        job = ClientJob(client_id=cid, round=state.round + 1, data=data, seed=sim.config.seed)
        for name in job.tasks:
            start = sim.strategy.task_parameters(state, name, sim.client_stores)
            trained, _ = trainer.train(start, data[name], seed=job.seed_for(name))
            metric = tasks[name].metric
            scores[name].append(evaluate(sim.host, trained, sim.test_data[name], metric,
                                         sim.config.eval_batch_size)[metric])
    return scores


def personalize(run: Simulation | str | Path, epochs: float = 1.0, state: GlobalState | None = None) -> dict:
    """FedAvg+Local: per task, `before` (the federated model's metric), `after` (the mean over the
    task's holders of their fine-tuned models' metric), `forgetting_ratio` and `clients`. `run` is a
    finished run's folder, or a Simulation with its final `state`."""
    if isinstance(run, Simulation):
        if state is None:
            raise ValueError("personalize: give the final `state` with a Simulation, or pass the run's folder")
        sim = run
    else:
        sim, state, _ = open_finished_run(run)
    before = sim.evaluate_all(state)
    after = fine_tune_locally(sim, state, epochs=epochs)
    out = {}
    for t in sim.tasks:
        b, a = before[t.name][t.metric], float(np.mean(after[t.name]))
        out[t.name] = {"metric": t.metric, "before": b, "after": a, "forgetting_ratio": forgetting_ratio(b, a),
                       "clients": len(after[t.name])}
    return out


def local_only(run: Simulation | RunConfig) -> dict:
    """Local-only: per task, the mean over its holders (`per_client`) of the metric of a model each
    trained alone from the initial state with the run's budget (`rounds` × `local_steps` steps when
    set, else `rounds` × `local_epochs` epochs)."""
    sim = run if isinstance(run, Simulation) else Simulation(run)
    c = sim.config
    budget = {"max_steps": c.rounds * c.local_steps} if c.local_steps > 0 else {"epochs": c.rounds * c.local_epochs}
    scores = fine_tune_locally(sim, sim.initial_state(), **budget)
    return {t.name: {"metric": t.metric, t.metric: float(np.mean(scores[t.name])), "per_client": scores[t.name]}
            for t in sim.tasks}
