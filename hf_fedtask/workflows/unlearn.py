"""Forgetting a task or a client after training, two ways (NTKFedAvg: Muhamed, Mankikar and Smith, 2024,
openreview.net/forum?id=K8jxsDF9xO; task arithmetic: Ilharco et al., ICLR 2023, arXiv:2212.04089):

- **federated** (`unlearn`): continue a finished FedAvg-family run for R more rounds in which the
  updates of the clients holding the forgotten task (or of the forgotten client) are negated before
  aggregation (NTKFedAvg's Alg. 1, lines 8–9). It is an ordinary run warm-started from the finished
  one, so it logs, checkpoints, resumes, plots (`unlearning.png`) and exports like any other, into its
  own folder.
- **server-side removal of a client** (`remove_client`, F²L² runs): one Newton step on the server's
  own data, no message to any client (`hf_fedtask.strategies.f2l2`); or, as the baseline the paper
  compares with, stochastic gradient ascent on the client's own data (`method="sga"`, one message).
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
from hf_fedtask.core.state import SHARED, head_name, tracked_task_vector_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.engine.results import summarize_results
from hf_fedtask.engine.run import RoundContext, run, run_export
from hf_fedtask.engine.run_folder import (
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    check_output_dir,
    checkpoint_allocation,
    claim_output_dir,
    load_run_config,
    open_finished_run,
)
from hf_fedtask.engine.server import Server
from hf_fedtask.errors import ConfigError, OutputDirError
from hf_fedtask.export.artifacts import export_adapters
from hf_fedtask.strategies import build_strategy
from hf_fedtask.strategies.base import task_model
from hf_fedtask.strategies.f2l2 import CLIENTS, COMPLETE_TAIL, NO_FACTORS, RemovalOptions


def _run_name_part(name: str) -> str:
    """`name` as it may appear in a folder name; anything else is refused."""
    if not name or any(c in name for c in "/\\\0") or name in (".", ".."):
        raise ConfigError(f"unknown task {name!r}")
    return name


def _checked_run_config(run_dir: Path):
    if not (run_dir / RUN_CONFIG_FILE).exists() or not (run_dir / CHECKPOINT_FILE).exists():
        raise OutputDirError(f"{run_dir}: not a finished hf_fedtask run "
                             f"(needs {RUN_CONFIG_FILE} and {CHECKPOINT_FILE})")
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
    if not build_strategy(parent.strategy, parent.strategy_options).capabilities.federated_unlearning:
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
    config = dataclasses.replace(parent.with_options(**change), rounds=finished.state.round + rounds,
                                 output_dir=str(out))
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
    out = (Path(output_dir) if output_dir is not None
           else run_dir.with_name(f"{run_dir.name}-negate-{_run_name_part(task)}"))
    config = dataclasses.replace(load_run_config(run_dir), output_dir=str(out))
    _check_one_step_output(config, overwrite, "one-shot negation")
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
    results["config"] = config.to_dict()  # the run's, written to `out` (where results.json says it is)
    results["unlearning"] = {"method": "one-shot: the task's vector, scaled, was subtracted from the merged model",
                             "tasks": [task], "scale": scale,
                             "task_vector": str(task_vector or tracked_task_vector_name(task)),
                             "before": before, "after": after}
    with folder_lock(out):
        _check_one_step_output(config, overwrite, "one-shot negation")
        out = claim_output_dir(config, overwrite=overwrite)
        export_adapters(run_export(env, finished.stores), state, results, out)
        write_atomic(out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    return results


def _check_one_step_output(config, overwrite: bool, what: str) -> None:
    """`check_output_dir` for a result made in one step (a one-shot negation, a client removal): there is
    nothing to resume, so a folder that already holds one is refused naming what does work."""
    out = Path(config.output_dir)
    if (not overwrite and out.is_dir() and (out / RUN_CONFIG_FILE).exists()
            and load_run_config(out).fingerprint() == config.fingerprint()):
        raise OutputDirError(f"{out}: already holds a {what} of this run (one step: nothing to resume); pass "
                             "--overwrite to redo it there, or choose another --output-dir")
    check_output_dir(config, resume=False, overwrite=overwrite)


def _task_vector(state, task: str, source: str | Path | None, env) -> TaskVector:
    """τ_task: recorded by the run, or read from `source` relative to the run's PEFT init."""
    if source is None:
        key = tracked_task_vector_name(task)
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


REMOVAL_METHODS = ("f2l2", "sga")
REMOVED_MODEL = "model.safetensors"
"""The model after a removal (shared modules and head, PEFT saved names), beside the exports."""


def remove_client(run_dir: str | Path, client: int, *, method: str = "f2l2", l2: float | None = None,
                  rho: float | None = None, gradient: str = "auto", iterations: int = 200,
                  tolerance: float = 1e-6, trust_radius: float | None = None, hessian: str = "auto",
                  sga_epochs: float = 1.0, sga_lr: float = 1e-3,
                  output_dir: str | Path | None = None, overwrite: bool = False) -> dict:
    """Remove client `client` from a finished F²L² run in one step and write the result (evaluated,
    exported, carded) to `output_dir` (default `<run_dir>-remove-client<K>-<method>`).

    `f2l2`: w₋ = w* − (H_s + λI)⁻¹·g₋ on the server alone (`F2L2.remove_client`; λ = `rho`·λ_max(H_s) or
    an absolute `l2`, by default the run's `removal_damping`; `gradient` the form of g₋, CG `iterations`
    and `tolerance`, `trust_radius` the step's cap as a multiple of ‖w* − w₀‖, by default the run's
    `removal_trust_radius`; `hessian` where H comes from: the retained clients' uploaded curvature factors
    (`clients`; runs with `curvature_rank` > 0), the server's slice (`server`), or `auto`, the clients'
    factors where the run has them). `sga`: the client runs `sga_epochs` of
    stochastic gradient ascent (SGD, `sga_lr`) on its own data's loss from w*. Returns the results,
    whose `unlearning` entry holds the metrics before and after, the wall time, one training round's
    median time and the number of client messages the removal took; the model itself is also saved
    as `REMOVED_MODEL`."""
    import statistics
    import time

    if method not in REMOVAL_METHODS:
        raise ConfigError(f"unknown removal method {method!r}; choose one of {', '.join(REMOVAL_METHODS)}")
    # checked before the run is opened: nothing is loaded or written for options the step would refuse
    options = (RemovalOptions(l2=l2, rho=rho, gradient=gradient, iterations=iterations, tolerance=tolerance,
                              trust_radius=trust_radius, hessian=hessian) if method == "f2l2" else None)
    if options is not None and options.hessian == CLIENTS and (Path(run_dir) / RUN_CONFIG_FILE).exists():
        if not load_run_config(run_dir).strategy_options.get("curvature_rank"):  # before loading anything
            raise ConfigError(NO_FACTORS)
    finished = open_finished_run(run_dir)
    run_dir, env, state = finished.run_dir, finished.env, finished.state
    strategy = env.strategy
    if not strategy.capabilities.client_removal:
        raise ConfigError(f"strategy {strategy.name!r} has no server-side removal (run strategy f2l2); "
                          "remove a client of a FedAvg-family run with `unlearn --client K --rounds R`")
    out = (Path(output_dir) if output_dir is not None
           else run_dir.with_name(f"{run_dir.name}-remove-client{client}-{method}"))
    if out.resolve() == run_dir.resolve():
        raise OutputDirError(f"{out}: removal writes a new folder; choose an output dir other than the original run")
    config = dataclasses.replace(load_run_config(run_dir), output_dir=str(out))
    _check_one_step_output(config, overwrite, "client removal")
    server = Server(env)
    before = server.evaluate(state, stores=finished.stores)
    if method == "f2l2":  # D_s is the server's own data, loaded with the run as the test split above is: the
        strategy.server_split(env, env.tasks[0].name)  # timed removal is the Newton step, not its preparation
    start = time.perf_counter()
    if method == "f2l2":
        removal = strategy.remove_client(state, env, client, options)
        new_state, messages = removal.state, 0
        details = {"l2": removal.l2, "damping": removal.damping, "rho": removal.rho,
                   "lambda_max": removal.lambda_max, "eigen_iterations": removal.eigen_iterations,
                   "gradient": removal.gradient, "form": removal.form, "difference_step": removal.difference_step,
                   "cg_iterations": removal.cg_iterations,
                   "relative_residual": removal.relative_residual, "step_norm": removal.step_norm,
                   "trust_radius": removal.trust_radius, "untrusted_l2": removal.untrusted_l2,
                   "solves": removal.solves, "ridge_lambda": strategy.ridge_lambda(state),
                   "hessian": removal.hessian, "curvature_tail": removal.curvature_tail,
                   "preconditioner_rank": removal.preconditioner_rank, "stationarity": removal.stationarity}
        h = "H₋" if removal.hessian == "clients" else "H_s"
        stored = removal.preconditioner_rank
        whole = removal.curvature_tail is not None and removal.curvature_tail <= COMPLETE_TAIL * removal.l2
        if removal.damping == "relative":
            scale = f" = ρ·λ_max({h}) = {removal.rho:g} × {removal.lambda_max:.4g}"
            if stored:
                scale += " (λ_max from the server's stored factor of H_s)"
        else:
            scale = (" = l2 + λ_r, the trained objective's own (the exact Newton step)"
                     if removal.damping == "objective" else " (absolute)")
            if removal.damping == "objective" and strategy.config.removal_damping == "auto":
                scale += (" (auto: the clients' factors hold the retained clients' whole curvature)" if whole else
                          f" (auto: ‖∇F(w*)‖ is {removal.stationarity:.2g} of the retained objective's gradient, "
                          "w* at the objective's optimum)")
        if removal.untrusted_l2 is not None:
            scale = (f", raised from {removal.untrusted_l2:.4g}{scale} until the step fitted the trust region "
                     f"‖step‖ ≤ {removal.trust_radius:.4g} ({removal.solves} solves)")
        form = f"{removal.form} form of g"
        if removal.gradient == "auto" and removal.form == "anchored":
            form += (f" (auto: the clients' factors leave out {removal.curvature_tail:.3g} of curvature, at most "
                     f"{COMPLETE_TAIL:g}·λ)")
        elif removal.gradient == "auto" and removal.difference_step is None and whole:
            form += (f" (auto: the clients' factors leave out {removal.curvature_tail:.3g} of curvature, at most "
                     f"{COMPLETE_TAIL:g}·λ, of an objective with l2 + λ_r > 0: the retrained objective's minimizer)")
        elif removal.gradient == "auto" and removal.difference_step is None:
            form += " (auto: at the optimum, the retained objective's gradient)"
        elif removal.gradient == "auto":
            fit = "fitted" if removal.form == "split" else "did not fit"
            form += (f" (auto: the difference form's step, {removal.difference_step:.4g}, {fit} the trust region "
                     f"{removal.trust_radius:.4g})")
        source = ("H₋ the retained clients' Hessian from the curvature factors they uploaded with their last-round "
                  "gradients" if removal.hessian == "clients" else "H_s the Hessian on the server's own data")
        newton = (f"w₀ − ({h} + λI)⁻¹·(g − {h}·(w − w₀))" if removal.form == "anchored" else f"w − ({h} + λI)⁻¹·g")
        preconditioned = (f" preconditioned by the rank-{stored} factor of H_s the server formed in the gradient "
                          "round" if stored else "")
        how = (f"one Newton step on the server, {newton}, {source}, with λ = {removal.l2:.4g}{scale} and "
               f"the {form}, solved by conjugate gradient{preconditioned} ({removal.cg_iterations} iterations, "
               f"relative residual {removal.relative_residual:.1e}); no client was contacted (F²L²)")
    else:
        new_state, messages = _gradient_ascent(strategy, state, env, client, sga_epochs, sga_lr), 1
        details = {"sga_epochs": sga_epochs, "sga_lr": sga_lr}
        how = (f"{sga_epochs:g} epoch(s) of stochastic gradient ascent (lr {sga_lr:g}) by the client on its own data "
               "(the SGA baseline)")
    seconds = time.perf_counter() - start
    after = server.evaluate(new_state, stores=finished.stores)
    record = {"round": state.round, "eval": after, "bytes_uplink": 0, "bytes_downlink": 0}
    results = summarize_results(env, new_state, [*finished.history, record])
    results["config"] = config.to_dict()  # the run's, written to `out` (where results.json says it is)
    trained = [r["seconds"] for r in finished.history if r.get("kind", "train") == "train" and "seconds" in r]
    results["unlearning"] = {"method": method, "how": how, "tasks": [], "forgotten_clients": [client],
                             "before": before, "after": after, "seconds": seconds,
                             "round_seconds": statistics.median(trained) if trained else None,
                             "client_messages": messages, **details}
    with folder_lock(out):
        _check_one_step_output(config, overwrite, "client removal")
        out = claim_output_dir(config, overwrite=overwrite)
        export_adapters(run_export(env, finished.stores), new_state, results, out)
        write_atomic(out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
        task = env.tasks[0].name
        task_model(new_state.vectors, task).save(out / REMOVED_MODEL)
    return results


def _gradient_ascent(strategy, state, env, client: int, epochs: float, lr: float):
    """The SGA baseline: the client ascends its own data's loss (the run's training objective, from
    w*, in the run's linearized model) with SGD; returns the new state."""
    from hf_fedtask.client.objectives import GradientAscent, OneHotMSE
    from hf_fedtask.client.trainer import LocalTrainer
    from hf_fedtask.core.state import GlobalState

    data = env.client_data(client)
    (task,) = sorted(data)
    w = task_model(state.vectors, task)
    point = strategy.linearization_point(state, task) if strategy.capabilities.linearized else None
    args = dataclasses.replace(env.trainer.args, local_epochs=epochs, local_steps=-1, learning_rate=lr,
                               optimizer="sgd", lr_scheduler="constant", warmup_steps=0, weight_decay=0.0)
    trained, _ = LocalTrainer(env.host, args).train(w, data[task], seed=env.config.local_training_seed,
                                                    objectives=[GradientAscent(OneHotMSE())], linearize_at=point)
    shared = state.vectors[SHARED]
    vectors = {SHARED: trained.filter(lambda k: k in shared),
               head_name(task): trained.filter(lambda k: k not in shared)}
    return GlobalState(state.round, {**state.vectors, **vectors}, dict(state.scalars))
