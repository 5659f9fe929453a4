"""A federated run, whatever the engine: claim the output folder, restore or initialise the state,
drive the shared round loop (`Server.round`) through the engine's transport, checkpoint and log
every round, and finish with results, plots and exports.

    run(config)                                  # in-process: every client here, one host model
    run(config, engine=grid_engine(grid))        # the same loop, clients in Flower SuperNodes
                                                 # (hf_fedtask.engine.flower.grid_engine)
    run(config, engine=local_grid_engine())      # ... or behind Flower messages in this process
                                                 # (hf_fedtask.engine.flower.local_grid_engine)
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from hf_fedtask.config import RunConfig
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from hf_fedtask.core.files import (
    LOCK_FILE,
    folder_lock,
    remove_stale_staging,
    write_atomic,
)
from hf_fedtask.core.state import SHARED, ClientStore, GlobalState
from hf_fedtask.data.reference import shipped_reference
from hf_fedtask.data.task import TaskInfo
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.inprocess import Federation  # noqa: F401  (re-exported: step rounds by hand)
from hf_fedtask.engine.ranks import RankTransport, rank_store, release_ranks, serve
from hf_fedtask.engine.server import Server, nonlinear_mean
from hf_fedtask.engine.transport import InProcessTransport, Transport
from hf_fedtask.errors import ConfigError, OutputDirError
from hf_fedtask.export.artifacts import RunExport, export_adapters
from hf_fedtask.export.compact import storage_report
from hf_fedtask.model.device import launch, peak_gpu_memory
from hf_fedtask.report import evaluated, forgetting, forgotten_what, plot_metric_vs_round, plot_unlearning

logger = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.yaml"
METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.json"
PLOT_FILE = "accuracy_vs_round.png"
UNLEARNING_PLOT_FILE = "unlearning.png"
PAYLOADS_DIR = "payloads"

Engine = Callable[[Environment], Transport]
"""An engine builds the transport that carries a run's instructions to its clients."""


def in_process(env: Environment) -> Transport:
    """The default engine: every client in this process, on the environment's one host model."""
    return InProcessTransport(env)


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The config a run folder was written with (earlier releases' layouts included)."""
    return RunConfig.from_yaml(Path(run_dir) / RUN_CONFIG_FILE, saved=True)


def check_output_dir(config: RunConfig, *, resume: bool, overwrite: bool) -> Path:
    """Refuse an `output_dir` that holds something else, before any work starts (read-only)."""
    run_dir = Path(config.output_dir)
    saved = run_dir / RUN_CONFIG_FILE
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputDirError(f"{run_dir}: exists and is not a directory; choose another --output-dir")
    if _holds_something(run_dir) and not overwrite:
        if not saved.exists():
            raise OutputDirError(f"{run_dir}: output dir is not empty and holds no hf_fedtask run; choose another --output-dir")
        previous = load_run_config(run_dir)
        if previous.fingerprint() != config.fingerprint():
            mine, theirs = config.flat(), previous.flat()
            changed = [k for k in sorted(set(mine) | set(theirs))
                       if k not in RunConfig.RESUMABLE_CHANGES and mine.get(k) != theirs.get(k)]
            raise OutputDirError(
                f"{run_dir}: already holds a different run (differs in {', '.join(changed)}); "
                "choose another --output-dir or pass --overwrite"
            )
        if not resume:
            raise OutputDirError(f"{run_dir}: already holds this run; pass --resume to continue it or --overwrite to restart")
    elif resume and not (run_dir / CHECKPOINT_FILE).exists():
        raise OutputDirError(f"{run_dir}: nothing to resume (no {CHECKPOINT_FILE})")
    return run_dir


def _holds_something(run_dir: Path) -> bool:
    return run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir())


def claim_output_dir(config: RunConfig, *, overwrite: bool) -> Path:
    """Clear the folder on `overwrite` (keeping the lock file) and write the run's config (call under its lock)."""
    run_dir = Path(config.output_dir)
    if overwrite and run_dir.exists():
        for p in run_dir.iterdir():
            if p.name != LOCK_FILE:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / RUN_CONFIG_FILE, config.to_yaml())
    return run_dir


@dataclass
class RoundContext:
    """Passed to round callbacks (progress hooks, tests that simulate a crash)."""

    round: int
    state: GlobalState
    record: dict


def restore(env: Environment, run_dir: str | Path, fingerprint: str,
            allocation: dict[int, list[str]] | None = None) -> tuple[GlobalState, list[dict], dict[int, ClientStore]]:
    """The state, history and client stores in `run_dir`'s checkpoint (of the run with `fingerprint`),
    validated against the strategy's layout for the checkpoint's round (its phase)."""
    initial = env.initial_state(allocation)
    return load_checkpoint(Path(run_dir), fingerprint=fingerprint,
                           template=lambda scalars: env.strategy.state_template(initial, scalars))


def read_history(run_dir: str | Path) -> list[dict]:
    """A run's round records, from its metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines()]


def checkpoint_allocation(run_dir: str | Path) -> dict[int, list[str]]:
    """The task allocation recorded in a checkpoint's header (so no data need be partitioned)."""
    from safetensors import safe_open

    with safe_open(str(Path(run_dir) / CHECKPOINT_FILE), "pt") as f:
        scalars = json.loads(f.metadata()["scalars"])
    return {int(c): tasks for c, tasks in scalars["allocation"].items()}


def run(
    config: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    callbacks: list[Callable[[RoundContext], None]] = (),
    warm_start: str | Path | None = None,
    engine: Engine = in_process,
) -> dict:
    """Run (or resume) a federated job described by `config` with `engine`; returns the results dict
    that is also written to `output_dir/results.json`. `warm_start`: a finished run whose final state
    (and history) this run continues from, unless `output_dir` has its own checkpoint to resume."""
    here = launch()
    if here.multi_process:
        if engine is not in_process:
            raise ConfigError(f"this process is rank {here.rank} of a {here.world_size}-process launch: only the in-process "
                              "engine spreads its clients over ranks; start the Flower engines in one process")
        rank_store()  # join the launch's store; from here on Trainers see a single process
        if here.rank != 0:
            return serve(config)  # this rank trains the clients rank 0 sends it; rank 0 writes the run folder
        return _run_rank0(config, resume=resume, overwrite=overwrite, callbacks=callbacks, warm_start=warm_start)
    return _run(config, resume=resume, overwrite=overwrite, callbacks=callbacks, warm_start=warm_start, engine=engine)


def _run_rank0(config: RunConfig, **kwargs) -> dict:
    """Rank 0 of a multi-process launch: the run with its clients over every rank (`RankTransport`);
    the other ranks are released with the run's results, or with its error wherever it arose."""
    transports = []

    def ranks_engine(env: Environment) -> Transport:
        transports.append(RankTransport(env))
        return transports[-1]

    try:
        results = _run(config, engine=ranks_engine, **kwargs)
    except BaseException as exc:
        try:
            transports[0].finish(error=exc) if transports else release_ranks(config, exc)
        except Exception as lost:  # the store is gone: the launcher ends the other ranks when this one exits
            logger.warning("could not release the other ranks: %s", lost)
        raise
    transports[0].finish(results)
    return results


def _run(config: RunConfig, *, resume, overwrite, callbacks, warm_start, engine: Engine) -> dict:
    check_output_dir(config, resume=resume, overwrite=overwrite)
    with folder_lock(config.output_dir):  # one writer per run folder, released on any exit
        check_output_dir(config, resume=resume, overwrite=overwrite)  # again: another writer may have been first
        env = Environment(config)
        server = Server(env)
        server.check()  # bad suite/task/model names and unsupported settings fail here, before anything is written
        return _run_locked(env, server, engine, resume=resume, overwrite=overwrite, callbacks=callbacks,
                           warm_start=warm_start)


def _run_locked(env: Environment, server: Server, engine: Engine, *, resume, overwrite, callbacks, warm_start) -> dict:
    config = env.config
    run_dir = Path(config.output_dir)
    state, history, stores = env.initial_state(), [], {}
    if resume and (run_dir / CHECKPOINT_FILE).exists():  # validated before anything is written
        state, history, stores = restore(env, run_dir, config.fingerprint())
    elif warm_start is not None:
        state, history, stores = restore(env, warm_start, load_run_config(warm_start).fingerprint())
    transport = engine(env)
    try:
        if config.export and env.strategy.capabilities.personal_state and transport.stores is None:
            raise ConfigError(f"strategy {env.strategy.name!r} keeps personal layers on the clients, which the "
                              f"{transport.name} engine does not hold: nothing per task can be exported; pass --no-export")
        if state.round > 0 and env.strategy.capabilities.personal_state and transport.stores is None:
            raise ConfigError(f"strategy {env.strategy.name!r} keeps personal layers on the clients; the "
                              f"{transport.name} engine keeps them on its nodes for one run only, so it cannot "
                              "resume or warm-start this run")
        run_dir = claim_output_dir(config, overwrite=overwrite)
        remove_stale_staging(run_dir)
        if config.save_payloads:
            server.payload_dir = run_dir / PAYLOADS_DIR
        if transport.stores is not None:
            transport.stores.update(stores)
        write_atomic(run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in history))
        tracker = _Tracker(config, run_dir)
        rounds = tqdm(range(state.round + 1, config.rounds + 1), desc="rounds", initial=state.round,
                      total=config.rounds, dynamic_ncols=True)
        for r in rounds:
            state, record = server.round(state, r, transport, evaluate=r % config.eval_every == 0 or r == config.rounds)
            history.append(record)
            save_checkpoint(run_dir, state, history=history, fingerprint=config.fingerprint(),
                            stores=transport.stores, **env.header())
            with open(run_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")
            tracker.log(record)
            if "mean_metric" in record:
                rounds.set_postfix(mean=f"{record['mean_metric']:.3f}")
            for cb in callbacks:
                cb(RoundContext(r, state, record))
        tracker.close()
        results = summarize_results(env, state, history, transport=transport)
        finish_run(env, state, results, history, run_dir, stores=transport.stores)
        return results
    finally:
        transport.close()


def finish_run(env: Environment, state: GlobalState, results: dict, history: list[dict], run_dir: Path,
               stores: dict[int, ClientStore] | None) -> None:
    """Plots, exports and results.json of a finished run."""
    config = env.config
    if history:
        plot_metric_vs_round(history, run_dir / PLOT_FILE, title=f"{env.strategy.name} on {config.suite or 'tasks'}")
    if "unlearning" in results and "from_round" in results["unlearning"]:
        plot_unlearning(history, run_dir / UNLEARNING_PLOT_FILE, chance={t.name: t.chance for t in env.tasks},
                        title=f"{env.strategy.name}: unlearning {forgotten_what(results['unlearning'])}")
    if config.export:
        compact = export_adapters(run_export(env, stores), state, results, run_dir)
        if compact is not None:
            results["compact_storage"] = storage_report(compact)
    write_atomic(run_dir / RESULTS_FILE, json.dumps(results, indent=2) + "\n")


def run_export(env: Environment, stores: dict[int, ClientStore] | None) -> RunExport:
    """What exporting a run needs (no data): the strategy, the tasks' metadata, the PEFT config."""
    host = env.host
    return RunExport(config=env.config, strategy=env.strategy, tasks=env.tasks,
                     peft_config=host.model.peft_config["default"], head_keys=host.head_keys,
                     base_model_id=host.base.model_id, stores=stores,
                     classifier_config=host.classifier_config(), processor=host.inputs.processor,
                     output_space=env.output_space)


@dataclass
class FinishedRun:
    """A run folder opened for export, unlearning or personalization: its environment (nothing
    tokenized until asked), final state, history and the client stores it checkpointed."""

    env: Environment
    state: GlobalState
    history: list[dict]
    stores: dict[int, ClientStore]
    run_dir: Path


def open_finished_run(run_dir: str | Path, tasks: list[TaskInfo] | None = None) -> FinishedRun:
    """A run folder's environment (from its saved config), final state, history and stores. `tasks`:
    the run's tasks without their data (`task_infos(results)`), for work that needs no data."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_CONFIG_FILE).exists() or not (run_dir / CHECKPOINT_FILE).exists():
        raise OutputDirError(f"{run_dir}: not a finished hf_fedtask run (needs {RUN_CONFIG_FILE} and {CHECKPOINT_FILE})")
    config = load_run_config(run_dir)
    env = Environment(config, tasks=tasks)
    state, history, stores = restore(env, run_dir, config.fingerprint(), allocation=checkpoint_allocation(run_dir))
    return FinishedRun(env, state, history, stores, run_dir)


def task_infos(results: dict, modality: str) -> list[TaskInfo]:
    """The tasks a results.json describes (label names, metric, chance, group), without their data."""
    return [TaskInfo(name, tuple(r["label_names"]), r["metric"], modality, r.get("chance"), r.get("group"))
            for name, r in results["tasks"].items()]


def summarize_results(env: Environment, state: GlobalState, history: list[dict], transport: Transport | None = None,
                      stores: dict | None = None) -> dict:
    """results.json: final per-task metrics (normalized by the shipped individual-centralized
    reference where one exists for the task and base model) and the run's metadata."""
    config, strategy = env.config, env.strategy
    final = history[-1]["eval"] if history and "eval" in history[-1] else Server(env).evaluate(state, transport, stores)
    compact = Server(env).evaluate_compact(state)  # the storage-saving export's own accuracy, reported beside
    reference = shipped_reference(config.base_model)
    tasks = {}
    for t in env.tasks:
        r = {**final[t.name], "metric": t.metric, "num_labels": t.num_labels, "label_names": t.label_names,
             "chance": t.chance, "group": t.group}
        if t.name in compact:
            r[f"{t.metric}_compact"] = compact[t.name]
        if t.name in reference and reference[t.name].get(t.metric):
            r["individual_centralized"] = reference[t.name][t.metric]
            r["normalized"] = r[t.metric] / r["individual_centralized"]
            if t.name in compact:
                r["normalized_compact"] = compact[t.name] / r["individual_centralized"]
        tasks[t.name] = r
    normalized = [r["normalized"] for r in tasks.values() if "normalized" in r]
    compact_summary = {"mean_metric_compact": float(np.mean(list(compact.values())))} if compact else {}
    if compact and len(normalized) == len(tasks):
        compact_summary["mean_normalized_compact"] = float(np.mean([r["normalized_compact"] for r in tasks.values()]))
    return {
        "strategy": strategy.name,
        "strategy_paper": strategy.paper,
        "hyperparameters": strategy.hyperparameters(),
        "config": config.to_dict(),
        "base_model": env.host.base.model_id,
        "base_model_revision": env.host.base.revision,
        "peft_method": config.peft_method,
        "device": str(env.host.device),
        "processes": launch().world_size,
        **({"peak_gpu_memory": gpu} if (gpu := peak_gpu_memory()) is not None else {}),
        "rounds": state.round,
        "num_clients": len(state.allocation),
        "allocation": {str(c): held for c, held in sorted(state.allocation.items())},
        "tasks": tasks,
        "mean_metric": float(np.mean([r[r["metric"]] for r in tasks.values()])),
        **nonlinear_mean(final, env.tasks),
        "mean_normalized": float(np.mean(normalized)) if len(normalized) == len(tasks) else None,
        **compact_summary,
        "bytes_uplink": sum(h["bytes_uplink"] for h in history),
        "bytes_downlink": sum(h["bytes_downlink"] for h in history),
        "shared_parameters": sum(t.numel() for t in state.vectors.get(SHARED, {}).values()),
        **{k: sum(h.get(k, 0) for h in history) for k in ("params_uplink", "params_downlink")},  # T x M x P
        **unlearning_summary(history, env, state),
    }


def unlearning_summary(history: list[dict], env: Environment, state: GlobalState) -> dict:
    """`{"unlearning": ...}` for a run that negated the forgotten tasks' or clients' updates: from
    which round, by how many clients, and each task's metric before and after (empty otherwise)."""
    if not env.strategy.capabilities.federated_unlearning:
        return {}
    options = env.strategy.config
    forget, forget_clients = options.forget_tasks or [], options.forget_clients or []
    first = next((h for h in history if forgetting(h)), None)
    if first is None:
        return {}
    before = next((h for h in reversed(evaluated(history)) if h["round"] < first["round"]), None)
    holders = sorted({c for c, tasks in state.allocation.items() if set(tasks) & set(forget)} | set(forget_clients))
    return {"unlearning": {
        "method": "federated: the updates of the forgotten clients (and of the clients holding the forgotten tasks) "
                  "were negated before aggregation",
        "tasks": forget,
        "forgotten_clients": forget_clients,
        "clients": holders,
        "from_round": first["round"],
        "rounds": history[-1]["round"] - first["round"] + 1,
        "before": {t: before["eval"][t] for t in before["eval"]} if before else None,
        "after": evaluated(history)[-1]["eval"],
    }}


class _Tracker:
    """Per-round metrics to Accelerate's trackers (`report_to`: tensorboard, wandb, ...)."""

    def __init__(self, config: RunConfig, run_dir: Path):
        self.accelerator = None
        report_to = [r for r in config.report_to if r != "none"]
        if report_to:
            from accelerate import Accelerator

            self.accelerator = Accelerator(log_with=report_to, project_dir=str(run_dir / "logs"))
            flat = {k: (json.dumps(v) if isinstance(v, (list, dict)) or v is None else v)
                    for k, v in config.flat().items()}
            self.accelerator.init_trackers("hf_fedtask", config=flat)

    def log(self, record: dict) -> None:
        if self.accelerator is None:
            return
        values = {"bytes_uplink": record["bytes_uplink"]}
        if "mean_metric" in record:
            values["mean_metric"] = record["mean_metric"]
        if record["train_loss"] is not None:
            values["train_loss"] = record["train_loss"]
        for task, ev in record.get("eval", {}).items():
            values.update({f"eval/{task}/{k}": v for k, v in ev.items() if k != "num_examples"})
        self.accelerator.log(values, step=record["round"])

    def close(self) -> None:
        if self.accelerator is not None:
            self.accelerator.end_training()
