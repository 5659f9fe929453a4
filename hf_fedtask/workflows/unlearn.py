"""Forgetting a task or a client after training, two ways (NTKFedAvg §5, task arithmetic):

- **federated** (`unlearn`): continue a finished FedAvg-family run for R more rounds in which the
  updates of the clients holding the forgotten task (or of the forgotten client) are negated before
  aggregation (Alg. 1, lines 8–9). It is an ordinary run warm-started from the finished one, so it
  logs, checkpoints, resumes, plots (`unlearning.png`) and exports like any other, into its own folder.
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

from hf_fedtask.core.checkpoint import CHECKPOINT_FILE
from hf_fedtask.core.files import folder_lock, write_atomic
from hf_fedtask.core.state import SHARED, head_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.engine.run import (
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    RoundContext,
    check_output_dir,
    checkpoint_allocation,
    claim_output_dir,
    load_run_config,
    open_finished_run,
    run,
    run_export,
    summarize_results,
)
from hf_fedtask.engine.server import Server
from hf_fedtask.errors import ConfigError, OutputDirError
from hf_fedtask.export.artifacts import export_adapters
from hf_fedtask.strategies import strategy_class
from hf_fedtask.strategies.fedavg import task_vector_name


def _run_name_part(name: str) -> str:
    """`name` as it may appear in a folder name; anything else is refused."""
    if not name or any(c in name for c in "/\\\0") or name in (".", ".."):
        raise ConfigError(f"unknown task {name!r}")
    return name


def _checked_run_config(run_dir: Path):
    if not (run_dir / RUN_CONFIG_FILE).exists() or not (run_dir / CHECKPOINT_FILE).exists():
        raise OutputDirError(f"{run_dir}: not a finished hf_fedtask run (needs {RUN_CONFIG_FILE} and {CHECKPOINT_FILE})")
    return load_run_config(run_dir)


def unlearn(run_dir: str | Path, task: str | None, rounds: int, *, client: int | None = None,
            output_dir: str | Path | None = None, resume: bool = False, overwrite: bool = False,
            callbacks: list[Callable[[RoundContext], None]] = ()) -> dict:
    """Federated unlearning of `task` (or of client `client`) for `rounds` rounds after the run in
    `run_dir` (left as is). Writes to `output_dir` (default `<run_dir>-unlearn-<task>` or
    `<run_dir>-unlearn-client<K>`) and returns its results, whose `unlearning` entry holds each
    task's metric before and after."""
    if (task is None) == (client is None):
        raise ConfigError("unlearn: give a task or a client")
    if rounds <= 0:
        raise ConfigError(f"unlearning rounds must be positive, got {rounds}")
    run_dir = Path(run_dir)
    parent = _checked_run_config(run_dir)  # the cheap checks come before the model is loaded
    if not strategy_class(parent.strategy).capabilities.federated_unlearning:
        raise ConfigError(f"strategy {parent.strategy!r} does not support federated unlearning; "
                          "use a FedAvg-family strategy (fedavg, fedprox, ntkfedavg, ntkfedprox)")
    allocation = checkpoint_allocation(run_dir)
    options = parent.strategy_options
    if task is not None:
        tasks = sorted({t for held in allocation.values() for t in held})
        if task not in tasks:
            raise ConfigError(f"unknown task {task!r}; the run's tasks are {', '.join(tasks)}")
        suffix, change = _run_name_part(task), {"forget_tasks": [*(options.get("forget_tasks") or []), task]}
    else:
        if not 0 <= client < len(allocation):
            raise ConfigError(f"unknown client {client}; the run has clients 0-{len(allocation) - 1}")
        suffix, change = f"client{client}", {"forget_clients": [*(options.get("forget_clients") or []), client]}
    finished = open_finished_run(run_dir)  # validates the checkpoint against the run's layout
    out = Path(output_dir) if output_dir is not None else run_dir.with_name(f"{run_dir.name}-unlearn-{suffix}")
    if out.resolve() == run_dir.resolve():
        raise OutputDirError(f"{out}: unlearning writes a new run; choose an output dir other than the original run")
    config = dataclasses.replace(parent.with_options(**change), rounds=finished.state.round + rounds, output_dir=str(out))
    return run(config, resume=resume, overwrite=overwrite, callbacks=callbacks, warm_start=run_dir)


def negate_task(run_dir: str | Path, task: str, *, scale: float = 1.0, task_vector: str | Path | None = None,
                output_dir: str | Path | None = None, overwrite: bool = False) -> dict:
    """One-shot unlearning: θ' = θ − scale·τ_task on the run's final model (shared modules and the task's head),
    evaluated on every task and exported (adapters + cards naming the removed task) to
    `output_dir` (default `<run_dir>-negate-<task>`). Returns the results written there."""
    finished = open_finished_run(run_dir)
    run_dir, env = finished.run_dir, finished.env
    if task not in {t.name for t in env.tasks}:
        raise ConfigError(f"unknown task {task!r}; the run's tasks are {', '.join(t.name for t in env.tasks)}")
    if not env.strategy.capabilities.task_vector_tracking:
        raise ConfigError(f"strategy {env.strategy.name!r} keeps no task vectors to negate; use a FedAvg-family run")
    out = Path(output_dir) if output_dir is not None else run_dir.with_name(f"{run_dir.name}-negate-{_run_name_part(task)}")
    config = dataclasses.replace(load_run_config(run_dir), output_dir=str(out))
    check_output_dir(config, resume=False, overwrite=overwrite)
    state, history = finished.state, finished.history
    tau = _task_vector(state, task, task_vector, env)
    server = Server(env)
    before = server.evaluate(state, stores=finished.stores)
    state.vectors[SHARED] = state.vectors[SHARED] - tau * scale
    head = head_name(task)  # the task's own head moved only for this task: its change is part of τ_task
    state.vectors[head] = state.vectors[head] - (state.vectors[head] - env.initial_heads[task]) * scale
    after = server.evaluate(state, stores=finished.stores)
    record = {"round": state.round, "eval": after, "bytes_uplink": 0, "bytes_downlink": 0}
    results = summarize_results(env, state, [*history, record])
    results["unlearning"] = {"method": "one-shot: the task's vector, scaled, was subtracted from the merged model",
                             "tasks": [task], "scale": scale, "task_vector": str(task_vector or task_vector_name(task)),
                             "before": before, "after": after}
    with folder_lock(out):
        check_output_dir(config, resume=False, overwrite=overwrite)
        out = claim_output_dir(config, overwrite=overwrite)
        export_adapters(run_export(env, finished.stores), state, results, out)
        write_atomic(out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    return results


def _task_vector(state, task: str, source: str | Path | None, env) -> TaskVector:
    """τ_task: recorded by the run, or read from `source` relative to the run's PEFT init."""
    if source is None:
        key = task_vector_name(task)
        if key not in state.vectors:
            raise ConfigError(f"the run did not record per-task vectors (run it with track_task_vectors: true), "
                              f"or pass a task vector / adapter folder for {task!r}")
        return state.vectors[key]
    from hf_fedtask.workflows.merge_adapters import read_input

    given = read_input(source)
    if given.config_hash != env.peft_hash:
        raise ConfigError(f"{source}: trained with another PEFT config than the run (peft_config_hash differs)")
    shared = state.vectors[SHARED]
    missing = sorted(set(shared) - set(given.tensors))
    if missing:
        raise ConfigError(f"{source}: lacks the run's PEFT module key {missing[0]!r}")
    tensors = given.tensors.filter(lambda k: k in shared)
    return tensors if given.delta else tensors - env.origin
