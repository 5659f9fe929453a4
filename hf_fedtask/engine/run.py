"""The federated run loop, whatever the engine: claim the output folder and restore or initialise
the state (`hf_fedtask.engine.run_folder`), drive the shared round loop (`Server.round`) through the
engine's transport, checkpoint and log every round, and finish with results.json
(`hf_fedtask.engine.results`), plots and exports.

    run(config)                                  # in-process: every client here, one host model
    run(config, engine=grid_engine(grid))        # the same loop, clients in Flower SuperNodes
                                                 # (hf_fedtask.engine.flower.grid_engine)
    run(config, engine=local_grid_engine())      # ... or behind Flower messages in this process
                                                 # (hf_fedtask.engine.flower.local_grid_engine)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from hf_fedtask.config import RunConfig
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE, save_checkpoint
from hf_fedtask.core.files import folder_lock, remove_stale_staging, write_atomic
from hf_fedtask.core.state import ClientStore, GlobalState
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.inprocess import Federation  # noqa: F401  (re-exported: step rounds by hand)
from hf_fedtask.engine.preflight import check_trackers
from hf_fedtask.engine.ranks import RankTransport, rank_store, release_ranks, serve
from hf_fedtask.engine.results import summarize_results
from hf_fedtask.engine.run_folder import (
    METRICS_FILE,
    PAYLOADS_DIR,
    PLOT_FILE,
    RESULTS_FILE,
    UNLEARNING_PLOT_FILE,
    check_output_dir,
    claim_output_dir,
    load_run_config,
    restore,
)
from hf_fedtask.engine.server import Server
from hf_fedtask.engine.transport import InProcessTransport, Transport
from hf_fedtask.errors import ConfigError
from hf_fedtask.export.artifacts import RunExport, export_adapters
from hf_fedtask.export.compact import storage_report
from hf_fedtask.model.device import launch
from hf_fedtask.report import forgotten_what, plot_metric_vs_round, plot_unlearning

logger = logging.getLogger(__name__)

Engine = Callable[[Environment], Transport]
"""An engine builds the transport that carries a run's instructions to its clients."""


def in_process(env: Environment) -> Transport:
    """The default engine: every client in this process, on the environment's one host model."""
    return InProcessTransport(env)


@dataclass
class RoundContext:
    """Passed to round callbacks (progress hooks, tests that simulate a crash)."""

    round: int
    state: GlobalState
    record: dict


def run(
    config: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    callbacks: list[Callable[[RoundContext], None]] = (),
    warm_start: str | Path | None = None,
    engine: Engine = in_process,
    on_start: Callable[[Environment, Server], None] | None = None,
) -> dict:
    """Run (or resume) a federated job described by `config` with `engine`; returns the results dict
    that is also written to `output_dir/results.json`. `warm_start`: a finished run whose final state
    (and history) this run continues from, unless `output_dir` has its own checkpoint to resume.
    `on_start`: called once every check has passed, before the run folder is claimed and the first round
    (the CLI prints the run's settings there: `hf_fedtask.engine.announce`); on rank 0 only."""
    here = launch()
    if here.multi_process:
        if engine is not in_process:
            raise ConfigError(f"this process is rank {here.rank} of a {here.world_size}-process launch: only the "
                              "in-process engine spreads its clients over ranks; "
                              "start the Flower engines in one process")
        rank_store()  # join the launch's store; from here on Trainers see a single process
        if here.rank != 0:
            return serve(config)  # this rank trains the clients rank 0 sends it; rank 0 writes the run folder
        return _run_rank0(config, resume=resume, overwrite=overwrite, callbacks=callbacks, warm_start=warm_start,
                          on_start=on_start)
    return _run(config, resume=resume, overwrite=overwrite, callbacks=callbacks, warm_start=warm_start, engine=engine,
                on_start=on_start)


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


def _run(config: RunConfig, *, resume, overwrite, callbacks, warm_start, engine: Engine, on_start=None) -> dict:
    check_trackers(config.report_to)
    check_output_dir(config, resume=resume, overwrite=overwrite)
    with folder_lock(config.output_dir):  # one writer per run folder, released on any exit
        check_output_dir(config, resume=resume, overwrite=overwrite)  # again: another writer may have been first
        env = Environment(config)
        server = Server(env)
        server.check()  # bad suite/task/model names and unsupported settings fail here, before anything is written
        return _run_locked(env, server, engine, resume=resume, overwrite=overwrite, callbacks=callbacks,
                           warm_start=warm_start, on_start=on_start)


def _run_locked(env: Environment, server: Server, engine: Engine, *, resume, overwrite, callbacks, warm_start,
                on_start=None) -> dict:
    config = env.config
    run_dir = Path(config.output_dir)
    state, history, stores = env.initial_state(), [], {}
    if resume and (run_dir / CHECKPOINT_FILE).exists():  # validated before anything is written
        state, history, stores = restore(env, run_dir, config.fingerprint())
        check_round_schedule(server, history, state.round, load_run_config(run_dir).rounds)
    elif warm_start is not None:
        state, history, stores = restore(env, warm_start, load_run_config(warm_start).fingerprint())
    # e.g. a resumed DP run's σ for its remaining rounds, or a refusal (DP, the communication budget): before anything
    # is written
    server.start(state, history)
    transport = engine(env)
    try:
        if config.export and env.strategy.capabilities.personal_state and transport.stores is None:
            raise ConfigError(f"strategy {env.strategy.name!r} keeps personal layers on the clients, which the "
                              f"{transport.name} engine does not hold: nothing per task can be exported; "
                              "pass --no-export")
        if state.round > 0 and env.strategy.capabilities.personal_state and transport.stores is None:
            raise ConfigError(f"strategy {env.strategy.name!r} keeps personal layers on the clients; the "
                              f"{transport.name} engine keeps them on its nodes for one run only, so it cannot "
                              "resume or warm-start this run")
        if on_start is not None:  # every check passed: what the run will do, before it writes anything
            on_start(env, server)
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


def check_round_schedule(server: Server, history: list[dict], finished: int, started_with: int) -> None:
    """A resume may change `rounds` (RunConfig.RESUMABLE_CHANGES), but under lr_round_schedule cosine the rounds set
    every round's learning rate: refuse a resume whose rounds would have trained the finished rounds (their rates
    recorded in `history`) at other rates, unless it trains no further round (`rounds` at or below `finished`, e.g.
    to end a run its communication budget stopped)."""
    config = server.config
    if config.rounds <= finished:
        return
    for record in history:
        rate = record.get("learning_rate")
        if rate is not None and rate != server.learning_rate(record["round"]):
            raise ConfigError(
                f"rounds: {config.rounds} differs from the {started_with} this run was started with, and "
                f"lr_round_schedule cosine anneals the learning rate over the rounds (round {record['round']} trained "
                f"at {rate:.6g}, with rounds {config.rounds} it would have at "
                f"{server.learning_rate(record['round']):.6g}): resume with --rounds {started_with}, or with --rounds "
                f"{finished} to end the run here")


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
                     classifier_config=host.classifier_config(), processor=host.export_processor(),
                     output_space=env.output_space, causal_lm=host.causal_lm)


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
        if "learning_rate" in record:
            values["learning_rate"] = record["learning_rate"]
        for task, ev in record.get("eval", {}).items():
            values.update({f"eval/{task}/{k}": v for k, v in ev.items() if k != "num_examples"})
        self.accelerator.log(values, step=record["round"])

    def close(self) -> None:
        if self.accelerator is not None:
            self.accelerator.end_training()
