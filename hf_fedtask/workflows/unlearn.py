"""Forgetting a task after training, two ways (NTKFedAvg §5, task arithmetic):

- **federated** (`unlearn`): continue a finished FedAvg-family run for R more rounds in which the
  updates of the clients holding the forgotten task are negated before aggregation (Alg. 1, lines
  8–9). It is an ordinary run warm-started from the finished one, so it logs, checkpoints, resumes,
  plots (`unlearning.png`) and exports like any other, into its own folder.
- **one-shot** (`negate_task`): subtract the task's vector, scaled, from the merged model:
  θ' = θ − λ·τ_task, where τ_task is the task's accumulated share of the run's updates to the
  shared modules (recorded with `track_task_vectors`) or a task vector the caller gives (a PEFT
  adapter folder or task-vector file, measured from the run's PEFT init), plus the change of the
  task's own head since its initialisation.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from hf_fedtask.export.artifacts import export_adapters
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE
from hf_fedtask.config import RunConfig
from hf_fedtask.errors import ConfigError, OutputDirError
from hf_fedtask.engine.run import (
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    RoundContext,
    Simulation,
    check_output_dir,
    claim_output_dir,
    restore,
    run,
    summarize_results,
    write_atomic,
)
from hf_fedtask.strategies.base import SHARED, head_name
from hf_fedtask.strategies.fedavg import task_vector_name
from hf_fedtask.core.taskvector import TaskVector


def _finished_run(run_dir: str | Path) -> tuple[Path, RunConfig]:
    run_dir = Path(run_dir)
    if not (run_dir / RUN_CONFIG_FILE).exists() or not (run_dir / CHECKPOINT_FILE).exists():
        raise OutputDirError(f"{run_dir}: not a finished hf_fedtask run (needs {RUN_CONFIG_FILE} and {CHECKPOINT_FILE})")
    return run_dir, RunConfig.from_yaml(run_dir / RUN_CONFIG_FILE)


def unlearn(run_dir: str | Path, task: str, rounds: int, *, output_dir: str | Path | None = None,
            resume: bool = False, overwrite: bool = False,
            callbacks: list[Callable[[RoundContext], None]] = ()) -> dict:
    """Federated unlearning of `task` for `rounds` rounds after the run in `run_dir` (left as is).
    Writes to `output_dir` (default `<run_dir>-unlearn-<task>`) and returns its results, whose
    `unlearning` entry holds each task's metric before and after."""
    run_dir, parent = _finished_run(run_dir)
    if rounds <= 0:
        raise ConfigError(f"unlearning rounds must be positive, got {rounds}")
    finished = _finished_round(run_dir)
    out = Path(output_dir) if output_dir is not None else run_dir.with_name(f"{run_dir.name}-unlearn-{task}")
    if out.resolve() == run_dir.resolve():
        raise OutputDirError(f"{out}: unlearning writes a new run; choose an output dir other than the original run")
    config = dataclasses.replace(parent, forget_tasks=[*(parent.forget_tasks or []), task],
                                 rounds=finished + rounds, output_dir=str(out))
    return run(config, resume=resume, overwrite=overwrite, callbacks=callbacks, warm_start=run_dir)


def _finished_round(run_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(run_dir / CHECKPOINT_FILE), "pt") as f:
        return int(f.metadata()["round"])


def negate_task(run_dir: str | Path, task: str, *, scale: float = 1.0, task_vector: str | Path | None = None,
                output_dir: str | Path | None = None, overwrite: bool = False) -> dict:
    """One-shot unlearning: θ' = θ − scale·τ_task on the run's final model (shared modules and the task's head),
    evaluated on every task and exported (adapters + cards naming the removed task) to
    `output_dir` (default `<run_dir>-negate-<task>`). Returns the results written there."""
    run_dir, parent = _finished_run(run_dir)
    out = Path(output_dir) if output_dir is not None else run_dir.with_name(f"{run_dir.name}-negate-{task}")
    config = dataclasses.replace(parent, output_dir=str(out))
    check_output_dir(config, resume=False, overwrite=overwrite)
    sim = Simulation(config)
    if task not in {t.name for t in sim.tasks}:
        raise ConfigError(f"unknown task {task!r}; the run's tasks are {', '.join(t.name for t in sim.tasks)}")
    state, history = restore(sim, run_dir, parent.fingerprint())
    tau = _task_vector(state, task, task_vector, sim)
    before = sim.evaluate_all(state)
    state.vectors[SHARED] = state.vectors[SHARED] - tau * scale
    head = head_name(task)  # the task's own head moved only for this task: its change is part of τ_task
    state.vectors[head] = state.vectors[head] - (state.vectors[head] - sim.initial_heads[task]) * scale
    after = sim.evaluate_all(state)
    record = {"round": state.round, "eval": after, "bytes_uplink": 0, "bytes_downlink": 0}
    results = summarize_results(sim, state, [*history, record])
    results["unlearning"] = {"method": "one-shot: the task's vector, scaled, was subtracted from the merged model",
                             "tasks": [task], "scale": scale, "task_vector": str(task_vector or task_vector_name(task)),
                             "before": before, "after": after}
    out = claim_output_dir(config, overwrite=overwrite)
    export_adapters(sim, state, results, out)
    write_atomic(out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    return results


def _task_vector(state, task: str, source: str | Path | None, sim: Simulation) -> TaskVector:
    """τ_task: recorded by the run, or read from `source` relative to the run's PEFT init."""
    if source is None:
        key = task_vector_name(task)
        if key not in state.vectors:
            raise ConfigError(f"the run did not record per-task vectors (run it with track_task_vectors: true), "
                              f"or pass a task vector / adapter folder for {task!r}")
        return state.vectors[key]
    from hf_fedtask.workflows.merge_adapters import read_input

    given = read_input(source)
    if given.config_hash != sim.peft_hash:
        raise ConfigError(f"{source}: trained with another PEFT config than the run (peft_config_hash differs)")
    shared = state.vectors[SHARED]
    missing = sorted(set(shared) - set(given.tensors))
    if missing:
        raise ConfigError(f"{source}: lacks the run's PEFT module key {missing[0]!r}")
    tensors = given.tensors.filter(lambda k: k in shared)
    return tensors if given.delta else tensors - sim.origin
