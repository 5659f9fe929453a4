"""The run folder: what a run writes where, which folder a run may claim, and reading a run back.

A run owns one `output_dir`: its config (`run_config.yaml`), a line per round (`metrics.jsonl`), the
checkpoint, `results.json`, plots and exports. The checks here run before any work starts, so a
folder holding something else, or a different run, is refused without touching it; the readers
reopen a finished run (its config, history, final state and client stores) for resuming, exporting,
unlearning and personalizing.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from hf_fedtask.config import RunConfig
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE, load_checkpoint
from hf_fedtask.core.files import LOCK_FILE, write_atomic
from hf_fedtask.core.state import ClientStore, GlobalState
from hf_fedtask.data.task import TaskInfo
from hf_fedtask.engine.environment import Environment

# the checks that need no model, data or torch live in `preflight` (the CLI runs them before importing the
# engine); they are this module's names too
from hf_fedtask.engine.preflight import (  # noqa: F401
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    check_finished_run,
    check_output_dir,
    load_run_config,
)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "accuracy_vs_round.png"
UNLEARNING_PLOT_FILE = "unlearning.png"
PAYLOADS_DIR = "payloads"


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
    the run's tasks without their data (`results.task_infos(results)`), for work that needs no data."""
    run_dir = check_finished_run(run_dir)
    config = load_run_config(run_dir)
    env = Environment(config, tasks=tasks)
    state, history, stores = restore(env, run_dir, config.fingerprint(), allocation=checkpoint_allocation(run_dir))
    return FinishedRun(env, state, history, stores, run_dir)
