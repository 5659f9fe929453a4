"""The in-process federated simulator: sample clients, run `client_update`, move each update through
its safetensors wire format (validated like any untrusted upload), `server_aggregate`, evaluate every
task, log, checkpoint atomically. One PEFT model serves every client.

The loop knows nothing about any algorithm: it only calls the strategy's two functions, so the same
strategy objects can be driven by other engines.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from hf_fedtask.export.artifacts import export_adapters, plot_metric_vs_round, plot_unlearning
from hf_fedtask.model.builders import build_host, build_trainer
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from hf_fedtask.export.compact import storage_report
from hf_fedtask.config import RunConfig
from hf_fedtask.data import build_federation, load_suite, load_task
from hf_fedtask.data.task import Task
from hf_fedtask.errors import ConfigError, OutputDirError
from hf_fedtask.client.evaluation import evaluate
from hf_fedtask.data.reference import shipped_reference
from hf_fedtask.engine.secure import open_secure_round
from hf_fedtask.strategies import ClientJob, GlobalState, Strategy, build_strategy
from hf_fedtask.strategies.base import SHARED, ClientStore, head_name
from hf_fedtask.core.taskvector import TaskVector, peft_config_hash
from hf_fedtask.core.wire import ClientUpdate, pack_vectors, unpack_vectors

logger = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.yaml"
METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.json"
PLOT_FILE = "accuracy_vs_round.png"
UNLEARNING_PLOT_FILE = "unlearning.png"
PAYLOADS_DIR = "payloads"


def load_tasks(config: RunConfig) -> list[Task]:
    if config.tasks:
        tasks = [load_task(ref, seed=config.seed) for ref in config.tasks]
    else:
        tasks = load_suite(config.suite, seed=config.seed)
    if config.max_train_samples:
        for t in tasks:
            n = min(config.max_train_samples, len(t.dataset["train"]))
            t.dataset["train"] = t.dataset["train"].shuffle(seed=config.seed).select(range(n))
    return tasks


def write_atomic(path: Path, content: str | bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if isinstance(content, bytes):
        tmp.write_bytes(content)
    else:
        tmp.write_text(content)
    os.replace(tmp, path)


def check_output_dir(config: RunConfig, *, resume: bool, overwrite: bool) -> Path:
    """Refuse an `output_dir` that holds something else, before any work starts (read-only)."""
    run_dir = Path(config.output_dir)
    saved = run_dir / RUN_CONFIG_FILE
    if run_dir.exists() and any(run_dir.iterdir()) and not overwrite:
        if not saved.exists():
            raise OutputDirError(f"{run_dir}: output dir is not empty and holds no hf_fedtask run; choose another --output-dir")
        previous = RunConfig.from_yaml(saved)
        if previous.fingerprint() != config.fingerprint():
            changed = [k for k, v in config.to_dict().items()
                       if k not in RunConfig.RESUMABLE_CHANGES and previous.to_dict()[k] != v]
            raise OutputDirError(
                f"{run_dir}: already holds a different run (differs in {', '.join(changed)}); "
                "choose another --output-dir or pass --overwrite"
            )
        if not resume:
            raise OutputDirError(f"{run_dir}: already holds this run; pass --resume to continue it or --overwrite to restart")
    elif resume and not (run_dir / CHECKPOINT_FILE).exists():
        raise OutputDirError(f"{run_dir}: nothing to resume (no {CHECKPOINT_FILE})")
    return run_dir


def claim_output_dir(config: RunConfig, *, overwrite: bool) -> Path:
    run_dir = Path(config.output_dir)
    if overwrite and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config.save_yaml(run_dir / RUN_CONFIG_FILE)
    return run_dir


@dataclass
class RoundContext:
    """Passed to round callbacks (progress hooks, tests that simulate a crash)."""

    round: int
    state: GlobalState
    record: dict


class Simulation:
    """Everything a run needs, built once: tasks, client data, the one host model, the strategy."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.strategy: Strategy = build_strategy(config.strategy, config.to_dict())
        self.tasks = load_tasks(config)
        self.host = build_host(config)
        self.base = self.host.base
        self.peft_hash = peft_config_hash(self.host.model.peft_config["default"])
        num_clients = config.num_clients or len(self.tasks)
        federation = build_federation(
            self.tasks,
            num_clients,
            zeta=config.zeta,
            partition=config.partition,
            alpha=config.alpha,
            classes_per_client=config.classes_per_client,
            seed=config.seed,
            min_samples=config.min_samples,
        )
        by_name = {t.name: t for t in self.tasks}
        self._check_forget_tasks(by_name)
        self.client_data = [
            {name: self.host.tokenize(ds, by_name[name]) for name, ds in client.items()} for client in federation
        ]
        self.test_data = {t.name: self.host.tokenize(t.dataset["test"], t) for t in self.tasks}
        self.client_stores: dict[int, ClientStore] = {cid: {} for cid in range(len(self.client_data))}
        self.payload_dir: Path | None = None  # set to keep each round's wire bytes on disk
        self.trainer = build_trainer(self.host, config)
        if getattr(self.strategy, "secure_aggregation", False) and self.clients_per_round < 2:
            raise ConfigError(f"secure_aggregation needs at least 2 clients per round, this run samples "
                              f"{self.clients_per_round}: raise participation or num_clients")
        initial = self.initial_state()  # before any training: the seeded PEFT init θ_p and heads
        self.origin = initial.vectors.get(SHARED)  # None when no module is shared (FedYolo, share="none")
        self.initial_heads = {t.name: initial.vectors[head_name(t.name)] for t in self.tasks}

    def _check_forget_tasks(self, tasks: dict[str, Task]) -> None:
        forget = self.config.forget_tasks or []
        if forget and not hasattr(self.strategy, "forget_tasks"):
            raise ConfigError(f"strategy {self.strategy.name!r} does not support federated unlearning (forget_tasks); "
                              "use a FedAvg-family strategy (fedavg, fedprox, ntkfedavg, ntkfedprox)")
        unknown = [t for t in forget if t not in tasks]
        if unknown:
            raise ConfigError(f"forget_tasks: unknown task {unknown[0]!r}; the run's tasks are {', '.join(tasks)}")

    @property
    def allocation(self) -> dict[int, list[str]]:
        """A(n, t): client id -> the tasks it holds."""
        return {cid: sorted(data) for cid, data in enumerate(self.client_data)}

    def initial_state(self) -> GlobalState:
        return self.strategy.init_state(self.host, self.tasks, self.config.seed, self.allocation)

    @property
    def num_clients(self) -> int:
        return len(self.client_data)

    def header(self) -> dict:
        """Header fields every update must carry: the base model and PEFT config it was trained for."""
        return {
            "base_model": self.base.model_id,
            "base_model_revision": self.base.revision,
            "peft_config_hash": self.peft_hash,
        }

    def sample_clients(self, round_: int) -> list[int]:
        """Participation ξ: a seeded sample of ⌈ξ·N⌉ clients, a function of (seed, round) only."""
        rng = np.random.default_rng([self.config.seed, round_])
        return sorted(int(c) for c in rng.choice(self.num_clients, size=self.clients_per_round, replace=False))

    @property
    def clients_per_round(self) -> int:
        return max(1, int(np.ceil(self.config.participation * self.num_clients - 1e-9)))

    def evaluate_all(self, state: GlobalState) -> dict[str, dict]:
        """Each task's metric. For linearized strategies it is the linearized model's, and the
        ordinary model at the same parameters is reported as `<metric>_nonlinear`."""
        out = {}
        for t in self.tasks:
            params = self.strategy.task_parameters(state, t.name, self.client_stores)
            data, batch = self.test_data[t.name], self.config.eval_batch_size
            point = self.strategy.linearization_point(state, t.name)
            out[t.name] = evaluate(self.host, params, data, t.metric, batch, linearize_at=point,
                                   linearization=getattr(self.strategy, "linearization", "network"))
            if point is not None:
                out[t.name][f"{t.metric}_nonlinear"] = evaluate(self.host, params, data, t.metric, batch)[t.metric]
        return out

    def run_round(self, state: GlobalState, round_: int) -> tuple[GlobalState, dict]:
        start = time.perf_counter()
        clients = self.sample_clients(round_)
        updates: list[ClientUpdate] = []
        traffic: dict[int, dict[str, int]] = {}
        header = self.header()
        secure = open_secure_round(self, state, round_, clients)  # None unless uploads are masked and summed
        for cid in tqdm(clients, desc=f"round {round_} clients", leave=False, dynamic_ncols=True):
            tasks = sorted(self.client_data[cid])
            # both directions go through their safetensors bytes, so byte counts are exact
            sent = pack_vectors(self.strategy.downlink(state, cid, tasks)).to_bytes()
            downlink = unpack_vectors(TaskVector.from_bytes(sent, source=f"downlink to client {cid}"))
            job = ClientJob(client_id=cid, round=round_, data=self.client_data[cid], seed=self.config.seed,
                            origin=self.origin, initial_heads=self.initial_heads, store=self.client_stores[cid])
            update = self.strategy.client_update(downlink, job, self.trainer)
            payload = secure.upload(update) if secure else update.to_bytes(**header)
            # the paper's communication cost T x M x P counts parameters: P = numel of what is sent
            traffic[cid] = {"uplink": len(payload), "downlink": len(sent),
                            "params_uplink": sum(tv.numel() for tv in update.vectors.values()),
                            "params_downlink": sum(tv.numel() for tv in downlink.values())}
            if self.payload_dir is not None:
                folder = self.payload_dir / f"round_{round_}"
                folder.mkdir(parents=True, exist_ok=True)
                write_atomic(folder / f"client_{cid}.uplink.safetensors", payload)
                write_atomic(folder / f"client_{cid}.downlink.safetensors", sent)
            if secure:
                secure.receive(cid, payload)
                continue
            updates.append(
                ClientUpdate.from_bytes(
                    payload,
                    templates=self.strategy.update_templates(state, cid, tasks),
                    expect=header,
                    source=f"client {cid} (round {round_})",
                )
            )
        if secure:
            updates = [secure.finish()]  # the strategy sees the sum only
        state = self.strategy.server_aggregate(state, updates)
        evals = self.evaluate_all(state)
        losses = [v for u in updates for k, v in u.metrics.items() if k.endswith("train_loss")]
        metric_values = [evals[t.name][t.metric] for t in self.tasks]
        record = {
            "round": round_,
            "clients": clients,
            "train_loss": float(np.mean(losses)) if losses else None,
            "eval": evals,
            "mean_metric": float(np.mean(metric_values)),
            **_nonlinear_mean(evals, self.tasks),
            **_forgetting_metrics(evals, self.tasks, self.config.forget_tasks or []),
            "bytes_uplink": sum(t["uplink"] for t in traffic.values()),
            "bytes_downlink": sum(t["downlink"] for t in traffic.values()),
            "bytes_per_client": {str(c): t for c, t in traffic.items()},
            "params_uplink": sum(t["params_uplink"] for t in traffic.values()),
            "params_downlink": sum(t["params_downlink"] for t in traffic.values()),
            "seconds": round(time.perf_counter() - start, 3),
        }
        return state, record


def run(
    config: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    callbacks: list[Callable[[RoundContext], None]] = (),
    warm_start: str | Path | None = None,
) -> dict:
    """Run (or resume) a federated job described by `config`; returns the results dict that is also
    written to `output_dir/results.json`. `warm_start`: a finished run whose final state (and
    history) this run continues from, unless `output_dir` has its own checkpoint to resume."""
    build_strategy(config.strategy, config.to_dict())  # fail fast on a bad name
    check_output_dir(config, resume=resume, overwrite=overwrite)
    sim = Simulation(config)  # bad suite/task/model names fail here, before anything is written
    run_dir = claim_output_dir(config, overwrite=overwrite)
    if config.save_payloads:
        sim.payload_dir = run_dir / PAYLOADS_DIR
    state = sim.initial_state()
    history: list[dict] = []
    if resume and (run_dir / CHECKPOINT_FILE).exists():
        state, history = restore(sim, run_dir, config.fingerprint())
    elif warm_start is not None:
        state, history = restore(sim, warm_start, RunConfig.from_yaml(Path(warm_start) / RUN_CONFIG_FILE).fingerprint())
    write_atomic(run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in history))
    tracker = _Tracker(config, run_dir)
    header = sim.header()
    rounds = tqdm(range(state.round + 1, config.rounds + 1), desc="rounds", initial=state.round, total=config.rounds,
                  dynamic_ncols=True)
    for r in rounds:
        state, record = sim.run_round(state, r)
        history.append(record)
        save_checkpoint(run_dir, state, history=history, fingerprint=config.fingerprint(), stores=sim.client_stores,
                        **header)
        with open(run_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        tracker.log(record)
        rounds.set_postfix(mean=f"{record['mean_metric']:.3f}")
        for cb in callbacks:
            cb(RoundContext(r, state, record))
    tracker.close()
    results = summarize_results(sim, state, history)
    if history:
        plot_metric_vs_round(history, run_dir / PLOT_FILE, title=f"{sim.strategy.name} on {config.suite or 'tasks'}")
    if "unlearning" in results:
        plot_unlearning(history, run_dir / UNLEARNING_PLOT_FILE, chance={t.name: t.chance for t in sim.tasks},
                        title=f"{sim.strategy.name}: unlearning {', '.join(config.forget_tasks)}")
    if config.export:
        compact = export_adapters(sim, state, results, run_dir)
        if compact is not None:
            results["compact_storage"] = storage_report(compact)
    write_atomic(run_dir / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    return results


def restore(sim: Simulation, run_dir: str | Path, fingerprint: str) -> tuple[GlobalState, list[dict]]:
    """The state and history in `run_dir`'s checkpoint (of the run with `fingerprint`), validated
    against `sim`'s initial state; the clients' stores go back into `sim`."""
    state, history, stores = load_checkpoint(Path(run_dir), fingerprint=fingerprint, template=sim.initial_state())
    sim.client_stores.update(stores)
    return state, history


def open_finished_run(run_dir: str | Path) -> tuple[Simulation, GlobalState, list[dict]]:
    """A run folder's Simulation (from its saved config), final state and history."""
    config = RunConfig.from_yaml(Path(run_dir) / RUN_CONFIG_FILE)
    sim = Simulation(config)
    return (sim, *restore(sim, run_dir, config.fingerprint()))


def summarize_results(sim: Simulation, state: GlobalState, history: list[dict]) -> dict:
    """results.json: final per-task metrics (normalized by the shipped individual-centralized
    reference where one exists for the task and base model) and the run's metadata."""
    final = history[-1]["eval"] if history else sim.evaluate_all(state)
    reference = shipped_reference(sim.config.base_model)
    tasks = {}
    for t in sim.tasks:
        r = {**final[t.name], "metric": t.metric, "num_labels": t.num_labels, "label_names": t.label_names,
             "chance": t.chance, "group": t.group}
        if t.name in reference and reference[t.name].get(t.metric):
            r["individual_centralized"] = reference[t.name][t.metric]
            r["normalized"] = r[t.metric] / r["individual_centralized"]
        tasks[t.name] = r
    normalized = [r["normalized"] for r in tasks.values() if "normalized" in r]
    return {
        "strategy": sim.strategy.name,
        "strategy_paper": sim.strategy.paper,
        "hyperparameters": sim.strategy.hyperparameters(),
        "config": sim.config.to_dict(),
        "base_model": sim.base.model_id,
        "base_model_revision": sim.base.revision,
        "peft_method": sim.config.peft_method,
        "rounds": state.round,
        "num_clients": sim.num_clients,
        "tasks": tasks,
        "mean_metric": float(np.mean([r[r["metric"]] for r in tasks.values()])),
        **_nonlinear_mean(final, sim.tasks),
        "mean_normalized": float(np.mean(normalized)) if len(normalized) == len(tasks) else None,
        "bytes_uplink": sum(h["bytes_uplink"] for h in history),
        "bytes_downlink": sum(h["bytes_downlink"] for h in history),
        "shared_parameters": sum(t.numel() for t in state.vectors.get(SHARED, {}).values()),
        **{k: sum(h.get(k, 0) for h in history) for k in ("params_uplink", "params_downlink")},  # T x M x P
        **unlearning_summary(history, sim),
    }


def unlearning_summary(history: list[dict], sim: Simulation) -> dict:
    """`{"unlearning": ...}` for a run that negated the forgotten tasks' updates: from which round,
    by how many of their clients, and each task's metric before and after (empty otherwise)."""
    forget = sim.config.forget_tasks or []
    first = next((h for h in history if "forgotten" in h), None)
    if first is None:
        return {}
    before = next((h for h in reversed(history) if h["round"] < first["round"]), None)
    holders = sorted(c for c, tasks in sim.allocation.items() if set(tasks) & set(forget))
    return {"unlearning": {
        "method": "federated: the updates of the clients holding the forgotten tasks were negated before aggregation",
        "tasks": forget,
        "clients": holders,
        "from_round": first["round"],
        "rounds": history[-1]["round"] - first["round"] + 1,
        "before": {t: before["eval"][t] for t in before["eval"]} if before else None,
        "after": history[-1]["eval"],
    }}


def _forgetting_metrics(evals: dict[str, dict], tasks: list[Task], forget: list[str]) -> dict:
    """While unlearning: each forgotten task's metric and the mean over the retained tasks."""
    if not forget:
        return {}
    retained = [evals[t.name][t.metric] for t in tasks if t.name not in forget]
    return {"forgotten": {t.name: evals[t.name][t.metric] for t in tasks if t.name in forget},
            "retained_mean": float(np.mean(retained)) if retained else None}


def _nonlinear_mean(evals: dict[str, dict], tasks: list[Task]) -> dict:
    """`mean_metric_nonlinear` when the evaluation reports the ordinary model beside a linearized one."""
    values = [evals[t.name].get(f"{t.metric}_nonlinear") for t in tasks]
    return {"mean_metric_nonlinear": float(np.mean(values))} if values and None not in values else {}


class _Tracker:
    """Per-round metrics to Accelerate's trackers (`report_to`: tensorboard, wandb, ...)."""

    def __init__(self, config: RunConfig, run_dir: Path):
        self.accelerator = None
        report_to = [r for r in config.report_to if r != "none"]
        if report_to:
            from accelerate import Accelerator

            self.accelerator = Accelerator(log_with=report_to, project_dir=str(run_dir / "logs"))
            flat = {k: (json.dumps(v) if isinstance(v, (list, dict)) or v is None else v)
                    for k, v in config.to_dict().items()}
            self.accelerator.init_trackers("hf_fedtask", config=flat)

    def log(self, record: dict) -> None:
        if self.accelerator is None:
            return
        values = {"mean_metric": record["mean_metric"], "bytes_uplink": record["bytes_uplink"]}
        if record["train_loss"] is not None:
            values["train_loss"] = record["train_loss"]
        for task, ev in record["eval"].items():
            values.update({f"eval/{task}/{k}": v for k, v in ev.items() if k != "num_examples"})
        self.accelerator.log(values, step=record["round"])

    def close(self) -> None:
        if self.accelerator is not None:
            self.accelerator.end_training()
