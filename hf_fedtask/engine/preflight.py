"""What a run is checked for before torch, a model or a dataset is loaded and before anything is written:
the run folder (it holds nothing else, or this run to resume; --resume and --overwrite are not both
given; it can be created here), the clients against the tasks, and the base model (a folder that
exists, or a Hub id that loads here: `hf_fedtask.model.backbone.check_base_model`) and the DP options.

This module imports no torch, transformers, datasets or peft, so that `hf-fedtask run` answers a typo
within a second instead of after the engine's imports (`tests/test_cli_startup.py`). `run()` repeats
the run folder's checks under the folder's lock (`hf_fedtask.engine.run`).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path

from hf_fedtask.config import RunConfig
from hf_fedtask.core.files import CHECKPOINT_FILE, LOCK_FILE
from hf_fedtask.core.names import TRACKER_PACKAGES
from hf_fedtask.data.builtin_tasks import BUILTIN_TASKS, SUITES
from hf_fedtask.errors import ConfigError, OutputDirError
from hf_fedtask.model.backbone import check_base_model
from hf_fedtask.privacy.settings import UNSUPPORTED, check_options

RUN_CONFIG_FILE = "run_config.yaml"
RESULTS_FILE = "results.json"


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The config a run folder was written with (earlier releases' layouts included)."""
    return RunConfig.from_yaml(Path(run_dir) / RUN_CONFIG_FILE, saved=True)


def check_output_dir(config: RunConfig, *, resume: bool, overwrite: bool) -> Path:
    """Refuse an `output_dir` that holds something else, before any work starts (read-only)."""
    run_dir = Path(config.output_dir)
    saved = run_dir / RUN_CONFIG_FILE
    if resume and overwrite:
        raise OutputDirError("--resume and --overwrite exclude each other: --resume continues the run in "
                             f"{run_dir}, --overwrite deletes what it holds and starts over; give one")
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputDirError(f"{run_dir}: exists and is not a directory; choose another --output-dir")
    if _holds_something(run_dir) and not overwrite:
        if not saved.exists():
            raise OutputDirError(f"{run_dir}: output dir is not empty and holds no hf_fedtask run; "
                                 "choose another --output-dir")
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
            raise OutputDirError(f"{run_dir}: already holds this run; "
                                 "pass --resume to continue it or --overwrite to restart")
    elif resume and not (run_dir / CHECKPOINT_FILE).exists():
        raise OutputDirError(f"{run_dir}: nothing to resume (no {CHECKPOINT_FILE})")
    return run_dir


def check_finished_run(run_dir: str | Path, *, results: bool = False) -> Path:
    """Refuse a folder that is no finished run (its config and checkpoint; with `results`, its
    results.json too) before a finished run is opened (read-only)."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_CONFIG_FILE).exists() or not (run_dir / CHECKPOINT_FILE).exists():
        raise OutputDirError(f"{run_dir}: not a finished hf_fedtask run "
                             f"(needs {RUN_CONFIG_FILE} and {CHECKPOINT_FILE})")
    if results and not (run_dir / RESULTS_FILE).exists():
        raise ConfigError(f"{run_dir}: has no {RESULTS_FILE} (the run did not finish); resume it first")
    return run_dir


def _holds_something(run_dir: Path) -> bool:
    return run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir())


def check_creatable(run_dir: str | Path) -> None:
    """Refuse a run folder that cannot be written here: an existing folder this user may not write, a
    file on its path, or a parent in which no folder can be made (e.g. under /proc, where even root's
    `os.access` says yes). The last is tried by making the outermost missing folder and removing it
    at once, so nothing is left behind."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise OutputDirError(f"--output-dir {run_dir}: this user may not write there; choose a writable folder")
        return
    first_new = run_dir.absolute()
    while not first_new.parent.exists() and first_new.parent != first_new:
        first_new = first_new.parent
    parent = first_new.parent
    if not parent.is_dir():
        raise OutputDirError(f"--output-dir {run_dir}: {parent} is a file, not a folder; choose another --output-dir")
    try:
        os.mkdir(first_new)
    except FileExistsError:  # made meanwhile (a concurrent run): the lock decides between the two
        return
    except OSError as exc:
        raise OutputDirError(f"--output-dir {run_dir}: no folder can be made in {parent} "
                             f"({exc.strerror or exc}); choose a writable folder") from None
    try:
        os.rmdir(first_new)
    except OSError:  # another process wrote into it meanwhile: it is theirs now
        pass


def check_clients(config: RunConfig) -> None:
    """With zeta 0 each client holds one task, so every task needs a client of its own (the partitioner,
    `hf_fedtask.data.partition.task_shares`, would refuse it after the data are loaded)."""
    tasks = len(config.tasks or SUITES[config.suite])
    if config.zeta == 0 and config.client_count < tasks:
        raise ConfigError(f"--num-clients {config.client_count}: with --zeta 0 each client holds one task, so "
                          f"{config.client_count} clients cannot cover the {tasks} tasks; use --num-clients >= "
                          f"{tasks}, fewer tasks or --zeta > 0")


def check_tasks(config: RunConfig) -> None:
    """A task given as a path (`./data`, `/x`, `~/y`) exists, and a `builtin:NAME` names a builtin task:
    otherwise `load_task` would try it as a Hub dataset id, after the engine's and datasets' imports."""
    for ref in map(str, config.tasks or ()):
        if ref.startswith(("./", "../", "/", "~")) and not Path(ref).expanduser().exists():
            raise ConfigError(f"--tasks {ref}: no such folder or file")
        if ref.startswith("builtin:") and ref.removeprefix("builtin:") not in BUILTIN_TASKS:
            close = difflib.get_close_matches(ref.removeprefix("builtin:"), BUILTIN_TASKS, n=1, cutoff=0.75)
            raise ConfigError(f"--tasks {ref}: no such builtin task" + (f"; did you mean builtin:{close[0]}?"
                                                                        if close else ""))


def check_privacy(config: RunConfig) -> None:
    """The client-level DP options that need the config alone (`hf_fedtask.privacy.settings.check_options`),
    with what a builtin strategy declares read from its name and options: the strategies that refuse DP are
    named in `UNSUPPORTED`, and FedYolo's `secure_aggregation` is its option. `Server.check` repeats them with
    the strategy's own capabilities."""
    secure = bool(getattr(config.strategy_config, "secure_aggregation", False))
    check_options(config, config.strategy, config.strategy not in UNSUPPORTED, secure)


def check_trackers(report_to: list[str]) -> None:
    """Refuse a `report_to` tracker Accelerate does not know (it would raise once the folder is written) or
    whose package is not installed here (Accelerate's `filter_trackers` drops those silently, so nothing
    would be logged); read from `TRACKER_PACKAGES` without importing Accelerate (and so torch)."""
    for name in (n for n in report_to if n not in ("none", "all")):
        if name not in TRACKER_PACKAGES:
            raise ConfigError(f"report_to: {name!r} is no Accelerate tracker; choose from "
                              f"{', '.join(TRACKER_PACKAGES)} (or all)")
        if not any(importlib.util.find_spec(package) for package in TRACKER_PACKAGES[name]):
            raise ConfigError(f"report_to: the {name} tracker's package is not installed here (pip install "
                              f"{TRACKER_PACKAGES[name][0]}); Accelerate would leave it out and log nothing")


def preflight(config: RunConfig, *, resume: bool = False, overwrite: bool = False) -> None:
    """Every check of a run that needs no model, data or torch (one line each; nothing is written). The
    base model comes first: a mistyped one would otherwise read as "holds a different run"."""
    check_base_model(config.base_model, "--base-model")
    check_tasks(config)
    check_clients(config)
    check_privacy(config)
    check_trackers(config.report_to)
    check_output_dir(config, resume=resume, overwrite=overwrite)
    check_creatable(config.output_dir)
