"""What every recipe script shares: its defaults, an optional preset (a RunConfig YAML shipped beside
the recipe), a user `--config` and flags, layered in that order; then the run and its report.

    accelerate launch recipes/matu_30task.py                      # the recipe's defaults
    accelerate launch recipes/matu_30task.py --preset paper      # the paper setting (GPU + network)
    accelerate launch recipes/matu_30task.py --rounds 20         # any RunConfig key is a flag
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hf_fedtask.config import (
    RunConfig,
    add_config_arguments,
    config_from_args,
    load_yaml,
)
from hf_fedtask.errors import ConfigError, FedTaskError
from hf_fedtask.model.device import launch


def recipe_parser(description: str, presets: dict[str, Path]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    add_config_arguments(parser)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: OMP_NUM_THREADS when you set it, "
                        "else every core this process may use, also under `accelerate launch`)")
    parser.add_argument("--preset", choices=sorted(presets), help="a shipped RunConfig YAML: " +
                        "; ".join(f"{name} = {path.name}" for name, path in sorted(presets.items())))
    parser.add_argument("--resume", action="store_true", help="continue from the last finished round in --output-dir")
    parser.add_argument("--overwrite", action="store_true", help="delete what --output-dir holds and start over")
    return parser


def recipe_config(args: argparse.Namespace, defaults: dict, presets: dict[str, Path], ranks: bool = False) -> RunConfig:
    """defaults < preset < --config < flags; also sets torch's threads (`set_threads`) and prints them.
    `ranks`: the recipe is one `run`, which spreads its clients over a multi-process launch; the
    recipes that chain several runs and read their folders run in one process."""
    here = launch()
    if here.multi_process and not ranks:
        raise ConfigError(f"this recipe chains several runs and reads their folders, so it runs in one process "
                          f"(this is rank {here.rank} of {here.world_size}); "
                          "launch it without --nproc_per_node / --num_processes")
    print(f"torch threads: {set_threads(args.threads)}" + (f" (rank {here.rank} of {here.world_size})"
                                                           if here.multi_process else ""), flush=True)
    values = dict(defaults)
    if args.preset:
        path = presets[args.preset]
        values.update(load_yaml(path))
        RunConfig.from_dict(values, source=str(path))
    return config_from_args(args, defaults=values)


def run_recipe(description: str, defaults: dict, presets: dict[str, Path], argv: list[str] | None = None,
               after: Callable[[RunConfig, dict], None] | None = None) -> int:
    """Parse, run, print the report; bad input is one line on stderr and exit code 2."""
    from hf_fedtask.engine.run import run
    from hf_fedtask.report import run_report

    args = recipe_parser(description, presets).parse_args(argv)
    start = time.perf_counter()
    try:
        config = recipe_config(args, defaults, presets, ranks=True)
        results = run(config, resume=args.resume, overwrite=args.overwrite)
        here = launch()
        if here.rank == 0:  # under a multi-process launch, rank 0 reports (the others return its results)
            print(run_report(config, results))
        prefix = f"rank {here.rank} of {here.world_size}: " if here.multi_process else ""
        print(prefix + resource_report(time.perf_counter() - start), flush=True)  # each process its own memory
        if here.rank == 0 and after is not None:
            after(config, results)
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _accelerate_default_of_one() -> bool:
    """Whether OMP_NUM_THREADS=1 here is `accelerate launch`'s default rather than the user's choice:
    accelerate sets it in the script's environment when neither the user's environment nor
    `--num_cpu_threads_per_process` names a value. Read from the launcher's own environment and
    command line (Linux /proc); anything unreadable counts as the user's choice."""
    if os.environ.get("OMP_NUM_THREADS") != "1" or "ACCELERATE_DYNAMO_BACKEND" not in os.environ:
        return False
    try:
        parent = Path(f"/proc/{os.getppid()}")
        environ = parent.joinpath("environ").read_bytes().split(b"\0")
        cmdline = parent.joinpath("cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    launched = any(b"accelerate" in part for part in cmdline[:3])
    return (launched and not any(v.startswith(b"OMP_NUM_THREADS=") for v in environ)
            and not any(a.startswith(b"--num_cpu_threads_per_process") for a in cmdline))


def set_threads(requested: int | None) -> str:
    """Set torch's CPU threads for a recipe (or `hf-fedtask run` / `unlearn`, whose `--threads` is this) and
    say where the number came from: `--threads`, else the user's OMP_NUM_THREADS, else every core this
    process may use (replacing `accelerate launch`'s default of one thread, which leaves a 2-core machine
    half idle)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = max(1, cores // launch().local_world_size)  # the processes of a launch on this machine share its cores
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--threads must be at least 1, got {requested}")
        torch.set_num_threads(requested)
        return f"{requested} (--threads)"
    if _accelerate_default_of_one():
        torch.set_num_threads(cores)
        return f"{cores} (all cores; accelerate launch's default of 1 replaced: --threads or OMP_NUM_THREADS to choose)"
    if "OMP_NUM_THREADS" in os.environ:
        return f"{torch.get_num_threads()} (OMP_NUM_THREADS)"
    torch.set_num_threads(cores)
    return f"{cores} (all cores)"


def resource_report(seconds: float) -> str:
    """Wall time, this process's peak resident memory and, where CUDA was used, its peak GPU memory
    (`torch.cuda.max_memory_allocated`), as the README quotes them."""
    import resource

    from hf_fedtask.model.device import peak_gpu_memory

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    gpu = peak_gpu_memory()
    minutes, rest = divmod(round(seconds, 1), 60)  # rounded first: 359.97 s is 6 min 00.0 s, not 5 min 60.0 s
    return (f"wall time: {int(minutes)} min {rest:04.1f} s; peak RSS: {peak:.2f} GiB"
            + (f"; peak GPU memory: {gpu / 2**30:.2f} GiB" if gpu is not None else ""))


def presets_beside(script: str, **names: str) -> dict[str, Path]:
    """Preset name -> YAML path, for files in `presets/` next to the recipe `script`."""
    folder = Path(os.path.dirname(os.path.abspath(script))) / "presets"
    presets = {name: folder / file for name, file in names.items()}
    missing = [str(p) for p in presets.values() if not p.exists()]
    if missing:
        raise ConfigError(f"preset file not found: {missing[0]}")
    return presets
