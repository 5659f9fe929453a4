"""NTKFedAvg vs FedAvg on builtin-8 (one client per task), in two regimes, then unlearning one task.

    python recipes/ntkfedavg_8task.py                         # builtin-8, MiniLM + LoRA r=8, CPU
    python recipes/ntkfedavg_8task.py --forget kaomoji_valence --unlearn-rounds 5
    python recipes/ntkfedavg_8task.py --preset paper          # CLIP ViT-B/32, the 8 vision tasks (GPU + network)

The NTKFedAvg paper's protocol (Muhamed, Mankikar and Smith, 2024, openreview.net/forum?id=K8jxsDF9xO:
Alg. 1, §3.1 "CLIP setting" and §3.3) with a CPU budget: 8 clients, all in every round, 10
rounds, in two regimes: "one_epoch" (1 local epoch per round) and "local_work" (3 epochs per round:
local training close to convergence on these small tasks; the paper uses per-task epoch counts).
NTKFedAvg clients train the model linearized at the server state; its accuracy is the linearized
model's, and the ordinary model at the same parameters is reported beside it. Then, from each
local-work run, the `--forget` task is unlearned for `--unlearn-rounds` rounds by negating its
client's updates, and, one-shot, by subtracting its recorded task vector.

Writes `<output_dir>/ntkfedavg_8task.md` (per-round tables, final per-task table, unlearning table),
`accuracy_vs_round.png`, `unlearning.png`, and every run under `<output_dir>/<regime>/<strategy>/`
and `<output_dir>/unlearn/<strategy>/`. Rerunning reuses finished runs.
"""

import os
import sys

if "--preset" not in sys.argv:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from hf_fedtask.core.checkpoint import CHECKPOINT_FILE  # noqa: E402
from hf_fedtask.core.files import write_atomic  # noqa: E402
from hf_fedtask.engine.run_folder import RESULTS_FILE, read_history  # noqa: E402
from hf_fedtask.errors import FedTaskError  # noqa: E402
from hf_fedtask.report import evaluated, headline_metric, pyplot  # noqa: E402
from hf_fedtask.workflows.compare import run_comparison  # noqa: E402
from hf_fedtask.workflows.recipe import presets_beside, publish_results, recipe_config, recipe_parser  # noqa: E402
from hf_fedtask.workflows.unlearn import negate_task, unlearn  # noqa: E402

DEFAULTS = {
    "suite": "builtin-8",
    "num_clients": 8,
    "zeta": 0.0,
    "participation": 1.0,
    "rounds": 10,
    "max_train_samples": 128,
    "track_task_vectors": True,
    "output_dir": "runs/ntkfedavg8",
}
STRATEGIES = ["fedavg", "ntkfedavg"]
REGIMES = {"one_epoch": {"local_epochs": 1.0}, "local_work": {"local_epochs": 3.0}}
FORGET = "vader_polarity"


def main(argv=None) -> int:
    presets = presets_beside(__file__, paper="ntkfedavg_clip_vit_b32_8task.yaml")
    parser = recipe_parser(__doc__.splitlines()[0], presets)
    parser.add_argument("--forget", default=FORGET, help="the task to unlearn after training")
    parser.add_argument("--unlearn-rounds", type=int, default=5)
    parser.add_argument("--regimes", nargs="+", choices=sorted(REGIMES), default=list(REGIMES))
    args = parser.parse_args(argv)
    try:
        base = recipe_config(args, DEFAULTS, presets)
        table = run_comparison(base, STRATEGIES, {r: REGIMES[r] for r in args.regimes})
        unlearning = {}
        if "local_work" in table:
            out = Path(base.output_dir)
            for strategy in STRATEGIES:
                trained = out / "local_work" / strategy
                unlearning[strategy] = {
                    "federated": _unlearned(trained, args.forget, args.unlearn_rounds, out / "unlearn" / strategy),
                    "one_shot": _negated(trained, args.forget, out / "negate" / strategy),
                }
        report = write_report(base, table, unlearning, args.forget)
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.read_text())
    print(f"report: {report}  (plots: accuracy_vs_round.png, unlearning.png beside it)")
    publish_results(args, base.output_dir, report.read_text(), argv, __file__)
    return 0


def _finished(folder: Path, rounds: int | None = None) -> dict | None:
    path = folder / RESULTS_FILE
    if not path.exists():
        return None
    results = json.loads(path.read_text())
    return results if rounds is None or results["rounds"] == rounds else None


def _unlearned(trained: Path, task: str, rounds: int, out: Path) -> dict:
    total = json.loads((trained / RESULTS_FILE).read_text())["rounds"] + rounds
    return _finished(out, total) or unlearn(trained, task, rounds, output_dir=out,
                                             resume=(out / CHECKPOINT_FILE).exists())


def _negated(trained: Path, task: str, out: Path) -> dict:
    return _finished(out) or negate_task(trained, task, scale=1.0, output_dir=out, overwrite=True)


def _history(run_dir: Path) -> list[dict]:
    """The evaluated rounds of a run (the per-round tables and curves)."""
    return evaluated(read_history(run_dir))


def write_report(base, table: dict, unlearning: dict, forget: str) -> Path:
    out = Path(base.output_dir)
    curves = {(regime, strategy): _history(out / regime / strategy) for regime in table for strategy in table[regime]}
    lines = ["# NTKFedAvg vs FedAvg, one client per task", ""]
    for regime in table:
        lines += [f"**{regime}: mean test accuracy (%) per round**", "",
                  "| round | " + " | ".join(_columns(table[regime])) + " |",
                  "|---|" + "---|" * len(_columns(table[regime]))]
        rounds = [h["round"] for h in curves[(regime, STRATEGIES[0])]]
        for i, r in enumerate(rounds):
            cells = []
            for strategy in table[regime]:
                h = curves[(regime, strategy)][i]
                cells.append(f"{100 * h['mean_metric']:.1f}")
                if "mean_metric_nonlinear" in h:
                    cells.append(f"{100 * h['mean_metric_nonlinear']:.1f}")
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
        lines.append("")
    tasks = list(next(iter(next(iter(table.values())).values()))["tasks"])
    lines += ["**Final per-task test accuracy (%)**", "", "| regime | method | " + " | ".join(tasks) + " | mean |",
              "|---|---|" + "---|" * (len(tasks) + 1)]
    for regime in table:
        for strategy, r in table[regime].items():
            accs = [100 * r["tasks"][t][r["tasks"][t]["metric"]] for t in tasks]
            lines.append(f"| {regime} | {strategy} | " + " | ".join(f"{a:.1f}" for a in accs)
                         + f" | **{100 * r['mean_metric']:.1f}** |")
    if unlearning:
        title = f"**Unlearning `{forget}` from the local-work runs: `{forget}` accuracy / mean of the other tasks (%)**"
        lines += ["", title, "", "| round | " + " | ".join(unlearning) + " |", "|---|" + "---|" * len(unlearning)]
        hist = {s: _history(out / "unlearn" / s) for s in unlearning}
        reference = hist[STRATEGIES[0]]
        first = next(i for i, h in enumerate(reference) if "forgotten" in h)
        for i in range(max(first - 1, 0), len(reference)):  # the last training round, then the unlearning rounds
            cells = [f"{100 * hist[s][i]['eval'][forget]['accuracy']:.1f} / {100 * _retained(hist[s][i], forget):.1f}"
                     for s in unlearning]
            mark = "" if "forgotten" in reference[i] else " (trained)"
            lines.append(f"| {reference[i]['round']}{mark} | " + " | ".join(cells) + " |")
        cells = [f"{100 * u['one_shot']['unlearning']['after'][forget]['accuracy']:.1f} / "
                 f"{100 * _retained({'eval': u['one_shot']['unlearning']['after']}, forget):.1f}"
                 for u in unlearning.values()]
        lines.append("| one-shot τ negation (λ=1) | " + " | ".join(cells) + " |")
        chance = next(iter(unlearning.values()))["federated"]["tasks"][forget]["chance"]
        lines += ["", f"Chance level of `{forget}`: {100 * chance:.1f}%."]
        _plot_unlearning(hist, forget, chance, out / "unlearning.png")
    _plot_curves(curves, out / "accuracy_vs_round.png")
    path = out / "ntkfedavg_8task.md"
    write_atomic(path, "\n".join(lines) + "\n")
    return path


def _columns(by_strategy: dict) -> list[str]:
    cols = []
    for strategy, r in by_strategy.items():
        cols.append(f"{strategy} (linearized)" if "mean_metric_nonlinear" in r else strategy)
        if "mean_metric_nonlinear" in r:
            cols.append(f"{strategy} (same θ, non-linear)")
    return cols


def _retained(record: dict, forget: str) -> float:
    values = [headline_metric(record, t) for t in record["eval"] if t != forget]
    return sum(values) / len(values)


def _plot_curves(curves: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, ((regime, strategy), history) in enumerate(curves.items()):
        rounds = [h["round"] for h in history]
        style = "-" if regime == "local_work" else "--"
        line = ax.plot(rounds, [100 * h["mean_metric"] for h in history], style, marker=".", color=f"C{i}",
                       label=f"{strategy}, {regime}"
                       + (" (linearized)" if "mean_metric_nonlinear" in history[0] else ""))
        if "mean_metric_nonlinear" in history[0]:
            ax.plot(rounds, [100 * h["mean_metric_nonlinear"] for h in history], ":", color=line[0].get_color(),
                    label=f"{strategy}, {regime} (same θ, non-linear)")
    ax.set_xlabel("round")
    ax.set_ylabel("mean test accuracy (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_unlearning(hist: dict, forget: str, chance: float, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (strategy, history) in enumerate(hist.items()):
        rounds = [h["round"] for h in history]
        ax.plot(rounds, [100 * h["eval"][forget]["accuracy"] for h in history], "-", marker="o", color=f"C{i}",
                label=f"{strategy}: {forget} (forgotten)")
        ax.plot(rounds, [100 * _retained(h, forget) for h in history], "--", marker=".", color=f"C{i}",
                label=f"{strategy}: other tasks (mean)")
    start = next(h["round"] for h in next(iter(hist.values())) if "forgotten" in h)
    ax.axvline(start - 0.5, color="k", linewidth=1, linestyle="--", label="unlearning starts")
    ax.axhline(100 * chance, color="0.5", linewidth=1, linestyle=":", label="chance")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
