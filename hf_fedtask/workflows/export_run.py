"""Re-export a finished run from its folder alone: the checkpoint, the saved config, results.json and
the base model; the run's datasets are not read (they need not exist any more)."""

from __future__ import annotations

import json
from pathlib import Path

from hf_fedtask.core.files import folder_lock
from hf_fedtask.engine.results import task_infos
from hf_fedtask.engine.run import run_export
from hf_fedtask.engine.run_folder import RESULTS_FILE, load_run_config, open_finished_run
from hf_fedtask.errors import ConfigError
from hf_fedtask.export.artifacts import export_adapters
from hf_fedtask.export.compact import storage_report
from hf_fedtask.model.backbone import input_kind, resolve_base_model
from hf_fedtask.report import ADAPTERS_DIR


def export_run(run_dir: str | Path) -> list[Path]:
    """Rewrite `run_dir`'s adapters (and the strategy's other exports) from its checkpoint, with the
    metrics of its results.json; returns the written folders."""
    run_dir = Path(run_dir)
    results_file = run_dir / RESULTS_FILE
    if not results_file.exists():
        raise ConfigError(f"{run_dir}: has no {RESULTS_FILE} (the run did not finish); resume it first")
    try:
        results = json.loads(results_file.read_text())
        modality = input_kind(resolve_base_model(load_run_config(run_dir).base_model)).modality
        tasks = task_infos(results, modality)  # the run's datasets need not exist any more
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{results_file}: not a readable results file ({' '.join(str(e).split())})") from None
    finished = open_finished_run(run_dir, tasks=tasks)
    env = finished.env
    with folder_lock(run_dir):
        compact = export_adapters(run_export(env, finished.stores or None), finished.state, results, run_dir)
    paths = [run_dir / ADAPTERS_DIR / t.name for t in env.tasks]
    if compact is not None:
        results["compact_storage"] = storage_report(compact)
        paths.append(compact)
    return paths
