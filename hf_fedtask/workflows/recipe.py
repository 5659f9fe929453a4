"""What every recipe script shares: its defaults, an optional preset (a RunConfig YAML shipped beside
the recipe), a user `--config` and flags, layered in that order; then the run and its report.

    accelerate launch recipes/matu_30task.py                      # the recipe's defaults
    accelerate launch recipes/matu_30task.py --preset paper      # the paper setting (GPU + network)
    accelerate launch recipes/matu_30task.py --rounds 20         # any RunConfig key is a flag
    accelerate launch recipes/matu_30task.py --results-page docs/results/matu.md   # also into the docs

`--results-page PATH` (every recipe) also writes the table the recipe produced into a Markdown page, in a
section marked `<!-- results:<name> start -->` ... `<!-- results:<name> end -->` (`--results-section`, default:
the output folder's name) that a rerun replaces, with the command, the commit, the hardware and the date beside
it (`write_results_page`); the pages under `docs/results/` are written this way.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from hf_fedtask.config import (
    RunConfig,
    add_config_arguments,
    config_from_args,
    load_yaml,
)
from hf_fedtask.core.files import write_atomic
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
    add_results_page_arguments(parser)
    return parser


def add_results_page_arguments(parser: argparse.ArgumentParser) -> None:
    """`--results-page PATH` and `--results-section NAME`: where `publish_results` writes the recipe's table."""
    parser.add_argument("--results-page", type=Path, metavar="PATH",
                        help="also write the table into this Markdown page (e.g. docs/results/<paper>.md), in a "
                        "marked section that a rerun replaces, with the command, commit, hardware and date "
                        "(default: no page)")
    parser.add_argument("--results-section", metavar="NAME",
                        help="the section's name in --results-page (default: the output folder's name)")


def recipe_config(args: argparse.Namespace, defaults: dict, presets: dict[str, Path], ranks: bool = False) -> RunConfig:
    """defaults < preset < --config < flags; also sets torch's threads (`set_threads`) and prints them.
    `ranks`: the recipe is one `run`, which spreads its clients over a multi-process launch; the
    recipes that chain several runs and read their folders run in one process."""
    check_results_arguments(args)
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
               after: Callable[[RunConfig, dict], None] | None = None, script: str | None = None) -> int:
    """Parse, run, print the report (and with `--results-page` write it there, `script` being the recipe's file);
    bad input is one line on stderr and exit code 2."""
    from hf_fedtask.engine.run import run
    from hf_fedtask.report import run_report

    args = recipe_parser(description, presets).parse_args(argv)
    start = time.perf_counter()
    try:
        config = recipe_config(args, defaults, presets, ranks=True)
        results = run(config, resume=args.resume, overwrite=args.overwrite)
        here = launch()
        report = run_report(config, results) if here.rank == 0 else ""
        if here.rank == 0:  # under a multi-process launch, rank 0 reports (the others return its results)
            print(report)
        resources = resource_report(time.perf_counter() - start)
        prefix = f"rank {here.rank} of {here.world_size}: " if here.multi_process else ""
        print(prefix + resources, flush=True)  # each process its own memory
        if here.rank == 0:
            publish_results(args, config.output_dir, f"```text\n{report}\n{resources}\n```", argv, script)
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
    (`torch.cuda.max_memory_allocated`), as the README and the results pages quote them."""
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


# --- results pages: the recipe's table, written into docs/results/<paper>.md with what produced it -------------------

SECTION_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
NEW_SECTIONS = "<!-- results:new -->"  # where a page wants sections it does not hold yet


def _section_marks(section: str) -> tuple[str, str]:
    return f"<!-- results:{section} start -->", f"<!-- results:{section} end -->"


def recipe_command(script: str | os.PathLike, argv: Sequence[str] | None) -> list[str]:
    """The command line that ran a recipe: `python <script> <args>` (the script relative to the working folder
    where it lies inside it; `argv` None: this process's own arguments)."""
    path = Path(script)
    try:
        path = Path(os.path.relpath(path.resolve(), Path.cwd())) if path.resolve().is_relative_to(Path.cwd()) else path
    except (OSError, ValueError):
        pass
    return ["python", str(path), *(sys.argv[1:] if argv is None else [str(a) for a in argv])]


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "--no-optional-locks", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def source_commit(repo: str | os.PathLike | None = None, ignore: Sequence[str | os.PathLike] = ()) -> str:
    """`git rev-parse --short HEAD` of the checkout holding hf_fedtask (or `repo`), plus "+ uncommitted changes"
    when `git status --porcelain` lists anything but the paths under `ignore` (the results pages being written);
    "unknown" outside a git checkout."""
    repo = Path(repo) if repo is not None else Path(__file__).resolve().parents[2]
    head = _git(repo, "rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    top = Path((_git(repo, "rev-parse", "--show-toplevel") or str(repo)).strip()).resolve()
    skipped = [Path(p).resolve() for p in ignore]
    changed = []
    for line in (_git(repo, "status", "--porcelain", "--untracked-files=normal") or "").splitlines():
        name = line[3:].split(" -> ")[-1].strip('"')
        path = (top / name).resolve()
        if not any(path == s or s in path.parents for s in skipped):
            changed.append(name)
    return head.strip() + (" + uncommitted changes" if changed else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def hardware() -> str:
    """One line: the CPU model, the cores this process may use (of the machine's), torch's threads, the GPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    line = f"{_cpu_model()}, {cores} cores available (of {os.cpu_count() or cores})"
    try:
        import torch
    except ImportError:
        return line
    line += f", {torch.get_num_threads()} torch threads"
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return line + f"; GPU: {torch.cuda.get_device_name(0)}" + (f" (× {count})" if count > 1 else "")
    return line + "; no CUDA GPU"


def write_results_page(page: str | os.PathLike, section: str, table_md: str, command: Sequence[str], *,
                       repo: str | os.PathLike | None = None, when: datetime | None = None) -> Path:
    """Write `table_md` into the Markdown `page` as the section `section`, between
    `<!-- results:<section> start -->` and `<!-- results:<section> end -->`: a section of that name already there
    is replaced in place, any other text of the page is kept, and a new section goes just before the page's
    `<!-- results:new -->` mark, or at the end without one (a page that does not exist is created with a title).
    Above the table: the commit (`source_commit`), the hardware (`hardware`), the command (`command`, as a shell
    line) and the date (UTC)."""
    page = Path(page)
    section = SECTION_NAME.sub("-", section).strip("-") or "results"
    start, end = _section_marks(section)
    when = when or datetime.now(timezone.utc)
    block = "\n".join([
        start,
        f"Written by the recipe on {when.strftime('%Y-%m-%d %H:%M')} UTC (section `{section}`).",
        "",
        f"- commit: `{source_commit(repo, ignore=[page.parent])}`",
        f"- hardware: {hardware()}",
        "- command:",
        "",
        "```bash",
        shlex.join([str(c) for c in command]),
        "```",
        "",
        table_md.strip("\n"),
        end,
    ])
    text = page.read_text(encoding="utf-8") if page.exists() else f"# {page.stem}\n"
    found = re.search(re.escape(start) + r".*?" + re.escape(end), text, flags=re.DOTALL)
    if found:
        text = text[:found.start()] + block + text[found.end():]
    elif NEW_SECTIONS in text:
        at = text.index(NEW_SECTIONS)
        text = text[:at] + block + "\n\n" + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(page, text)
    return page


def check_results_arguments(args: argparse.Namespace) -> None:
    """Refuse `--results-section` without `--results-page` (it would name a section of no page), before any run."""
    if getattr(args, "results_section", None) and getattr(args, "results_page", None) is None:
        raise ConfigError(f"--results-section {args.results_section}: names a section of --results-page, which "
                          "was not given; add --results-page docs/results/<paper>.md or leave it out")


def publish_results(args: argparse.Namespace, output_dir: str | os.PathLike, table_md: str,
                    argv: Sequence[str] | None, script: str | os.PathLike | None = None) -> Path | None:
    """A recipe's last step: with `--results-page`, write `table_md` (the table the recipe wrote beside its runs)
    into that page (`write_results_page`), the section named by `--results-section` or the output folder."""
    page = getattr(args, "results_page", None)
    if page is None:
        return None
    section = getattr(args, "results_section", None) or Path(output_dir).name
    command = recipe_command(script if script is not None else sys.argv[0], argv)
    path = write_results_page(page, section, table_md, command)
    print(f"results page: {path} (section {section})", flush=True)
    return path
