"""Is MaTU's near-chance accuracy under label skew the budget or the algorithm? The label-skewed multi-task
setting of `recipes/matu_8task.py` (builtin-8, one shared 6-output head, 8 clients, ζ_t = 0.5, Dirichlet
α = 0.1 inside tasks: about 2.8 holders per task, each seeing mostly one label) run with more budget:

* more rounds: 24 rounds of one local epoch, evaluated every 4 rounds (the curve at 4, 8, …, 24);
* more local work: 8 rounds of 3 local epochs;

for MaTU with the per-task downlink (`downlink: per_task`, the delta step's fix: each client starts a
round from its own tasks' τ^t), MaTU as the 8-round tables ran it (`downlink: unified`), FedAvg, and
per-task FedAvg (FedYolo's per-task modules: no task shares parameters with another, so what is left is
label skew alone). `--methods ... scaffold fedavg_sgd` adds SCAFFOLD (control variates against client drift)
as a probe, beside FedAvg with the same SGD (SCAFFOLD corrects SGD steps; both at lr 0.3).

    python recipes/matu_label_skew.py                                  # 3 seeds, both studies
    python recipes/matu_label_skew.py --seeds 0 --studies rounds       # one seed, one study
    python recipes/matu_label_skew.py --seeds 1 --threads 1 &          # seeds side by side, a core each
    python recipes/matu_label_skew.py --seeds 2 --threads 1 &          # then the plain call tabulates all
    python recipes/matu_label_skew.py --tabulate-only                  # the table of the finished runs
    python recipes/matu_label_skew.py --tabulate-only --predictions    # + what each run predicts per task

Other flags go to `recipes/matu_8task.py` (any RunConfig key, e.g. `--learning-rate 0.001`).

Runs live under `<output_dir>_rounds/` and `<output_dir>_epochs/` (as `matu_8task.py` lays them out;
rerunning resumes or reuses them); `<output_dir>.md`, `.json` and `.png` hold the table and the curves.
About 12 minutes a 24-round run on 2 CPU cores (four methods: 50 minutes a seed), 10 a 3-epoch run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_fedtask.errors import FedTaskError  # noqa: E402
from hf_fedtask.workflows.recipe import (  # noqa: E402
    add_results_page_arguments,
    check_results_arguments,
    publish_results,
)

METHODS = ("matu_per_task_downlink", "matu", "fedavg", "per_task_fedavg", "scaffold", "fedavg_sgd")
STUDIES = ("rounds", "epochs")


def study_flags(study: str, args) -> list[str]:
    """What a study changes in matu_8task's protocol."""
    if study == "rounds":
        return ["--rounds", str(args.long_rounds), "--eval-every", str(args.eval_every)]
    return ["--rounds", str(args.epochs_rounds), "--local-epochs", str(args.local_epochs)]


def run_studies(args, extra: list[str]) -> None:
    """Each study through `matu_8task.main` (finished runs are reused, stopped ones resume); `extra`:
    further flags for matu_8task (any RunConfig key)."""
    import matu_8task

    for study in args.studies:
        methods = args.methods if study == "rounds" else args.epochs_methods
        argv = [*extra, "--settings", "multi_task", "--methods", *methods, "--seeds", *map(str, args.seeds),
                "--output-dir", f"{args.output_dir}_{study}", *study_flags(study, args)]
        argv += ["--threads", str(args.threads)] if args.threads else []
        if matu_8task.main(argv):
            raise SystemExit(2)


def curves(folder: Path) -> dict:
    """{method: {seed: {"rounds": {round: mean accuracy}, "train_loss": last round's}}} of finished runs."""
    from hf_fedtask.engine.run_folder import read_history

    out: dict = {}
    for results in sorted(folder.glob("seed*/multi_task/*/results.json")):
        run = results.parent
        rows = read_history(run)
        out.setdefault(run.name, {})[int(run.parent.parent.name.removeprefix("seed"))] = {
            "rounds": {r["round"]: r["mean_metric"] for r in rows if r.get("mean_metric") is not None},
            "train_loss": rows[-1].get("train_loss")}
    return out


def prediction_spread(output_dir: str) -> str:
    """Per finished run and task: test accuracy, how many classes the model predicts and the majority
    class's share of the test split (a model collapsed onto one class scores about that share). Written
    to `<output_dir>_predictions.md`."""
    import numpy as np

    from hf_fedtask.engine.run_folder import open_finished_run
    from hf_fedtask.engine.server import Server

    lines = ["| study | seed | method | task | accuracy % | classes predicted / classes | majority class % |",
             "|---|---|---|---|---|---|---|"]
    for study in STUDIES:
        for results in sorted(Path(f"{output_dir}_{study}").glob("seed*/multi_task/*/results.json")):
            run = open_finished_run(results.parent)
            for task in run.env.tasks:
                data = run.env.test_data(task.name)
                labels = np.asarray(data["labels"])
                preds = Server(run.env).predict(run.state, task.name, data)
                lines.append(f"| {study} | {results.parent.parent.parent.name.removeprefix('seed')} "
                             f"| {results.parent.name} | {task.name} | {100 * np.mean(preds == labels):.1f} "
                             f"| {len(np.unique(preds))} / {len(task.label_names)} "
                             f"| {100 * np.bincount(labels).max() / len(labels):.1f} |")
    text = "**What the finished runs predict on each task's test split**\n\n" + "\n".join(lines) + "\n"
    Path(f"{output_dir}_predictions.md").write_text(text)
    return text


def cell(values: list[float], scale: float = 100, digits: int = 1) -> str:
    """Mean ± std of `values` × `scale` (the mean alone for one value)."""
    if not values:
        return "-"
    mean = scale * statistics.mean(values)
    spread = f" ± {scale * statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
    return f"{mean:.{digits}f}{spread}"


def losses(by_seed: dict) -> str:
    return cell([s["train_loss"] for s in by_seed.values() if s["train_loss"] is not None], scale=1, digits=3)


def tabulate(output_dir: str, epochs_label: str) -> str:
    """The markdown table (seed means ± std; n = seeds) and `<output_dir>.json` / `.png`."""
    rounds, epochs = curves(Path(f"{output_dir}_rounds")), curves(Path(f"{output_dir}_epochs"))
    checkpoints = sorted({r for seeds in rounds.values() for s in seeds.values() for r in s["rounds"]})
    lines = ["| method | seeds | " + " | ".join(f"round {r}" for r in checkpoints)
             + f" | train loss, round {max(checkpoints, default='-')} | {epochs_label} (seeds) | train loss, "
             f"{epochs_label} |",
             "|---|---|" + "---|" * len(checkpoints) + "---|---|---|"]
    for method in [m for m in METHODS if m in rounds or m in epochs]:
        by_seed, by_seed_e = rounds.get(method, {}), epochs.get(method, {})
        cells = [cell([s["rounds"][r] for s in by_seed.values() if r in s["rounds"]]) for r in checkpoints]
        last_e = [s["rounds"][max(s["rounds"])] for s in by_seed_e.values() if s["rounds"]]
        lines.append(f"| {method} | {len(by_seed)} | " + " | ".join(cells)
                     + f" | {losses(by_seed)} | {cell(last_e)} ({len(last_e)}) | {losses(by_seed_e)} |")
    Path(f"{output_dir}.json").write_text(json.dumps({"rounds": rounds, "epochs": epochs}, indent=1) + "\n")
    from hf_fedtask.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for method, by_seed in rounds.items():
        xs = checkpoints
        ys = [100 * statistics.mean([s["rounds"][r] for s in by_seed.values() if r in s["rounds"]] or [float("nan")])
              for r in xs]
        ax.plot(xs, ys, marker="o", label=method)
    ax.set_xlabel("round (1 local epoch)")
    ax.set_ylabel("mean test accuracy %, seed mean")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{output_dir}.png", dpi=120)
    plt.close(fig)
    text = ("**Label-skewed multi-task clients (builtin-8, ζ_t = 0.5, Dirichlet α = 0.1), mean test accuracy %, "
            "seed mean ± std**\n\n" + "\n".join(lines) + "\n")
    Path(f"{output_dir}.md").write_text(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--studies", nargs="+", choices=list(STUDIES), default=list(STUDIES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS[:4]),
                        help="methods of the rounds study (scaffold: a drift-correcting probe, not by default)")
    parser.add_argument("--epochs-methods", nargs="+", choices=METHODS, default=["matu_per_task_downlink", "fedavg"],
                        help="methods of the local-epochs study")
    parser.add_argument("--long-rounds", type=int, default=24, help="rounds of the rounds study")
    parser.add_argument("--eval-every", type=int, default=4, help="the rounds study's evaluation interval")
    parser.add_argument("--epochs-rounds", type=int, default=8, help="rounds of the local-epochs study")
    parser.add_argument("--local-epochs", type=float, default=3.0, help="local epochs of the local-epochs study")
    parser.add_argument("--threads", type=int, help="torch CPU threads per run (1 when running seeds side by side)")
    parser.add_argument("--tabulate-only", action="store_true", help="only tabulate the runs already finished")
    parser.add_argument("--predictions", action="store_true",
                        help="also evaluate every finished run per task: classes predicted, accuracy against the "
                             "majority share (<output_dir>_predictions.md)")
    parser.add_argument("--output-dir", default="runs/matu8_skew")
    add_results_page_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    try:
        check_results_arguments(args)
    except FedTaskError as e:
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        return 2
    if not args.tabulate_only:
        run_studies(args, extra)
    table = tabulate(args.output_dir, f"{args.epochs_rounds} rounds × {args.local_epochs:g} epochs")
    print(table)
    print(f"table: {args.output_dir}.md  (and .json, .png)")
    publish_results(args, args.output_dir, table, argv, __file__)
    if args.predictions:
        prediction_spread(args.output_dir)
        print(f"predictions: {args.output_dir}_predictions.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
