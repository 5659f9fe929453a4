"""FedYolo's multitask protocol (its Table 1) on builtin tasks: task 0 alone, then tasks added one at a
time, for FedYolo, FedYolo share-half, modular FedAvg and full-update FedAvg; then Local-only vs
FedAvg vs FedAvg+Local (forgetting ratio) and the privacy variant's upload cost.

    python recipes/fedyolo_multitask.py                     # MiniLM, LoRA r=8, CPU
    python recipes/fedyolo_multitask.py --peft-method bottleneck
    python recipes/fedyolo_multitask.py --tasks-order langid_romance vader_polarity ...

Tasks, in the order they are added (the paper, Zhang et al., 2023, arXiv:2307.04905, adds CIFAR-10,
related to task 0, then unrelated CelebA and FEMNIST): first_name_gender (task 0), first_name_origin
(related: the same first names), then vader_polarity and langid_germanic (unrelated). Each task has
4 clients holding one task each (64 training samples each); half of all clients train per round, 3
local epochs, 8 rounds. Full-update FedAvg trains the whole backbone (peft_method "full") at learning
rate 5e-5; the modules use 5e-3. Accuracy is on each task's global test split.

Writes `<output_dir>/fedyolo_multitask.md` (tables), `fedyolo_multitask.json`,
`task0_vs_tasks.png`, and every run under `<output_dir>/<k>_tasks/<method>/`. Rerunning reuses
finished runs.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from hf_fedtask.core.files import write_atomic  # noqa: E402
from hf_fedtask.errors import FedTaskError  # noqa: E402
from hf_fedtask.report import pyplot  # noqa: E402
from hf_fedtask.workflows.compare import finished_results, run_comparison  # noqa: E402
from hf_fedtask.workflows.personalize import local_only, personalize  # noqa: E402
from hf_fedtask.workflows.recipe import publish_results, recipe_config, recipe_parser  # noqa: E402

TASKS = ["first_name_gender", "first_name_origin", "vader_polarity", "langid_germanic"]
DEFAULTS = {
    "suite": None,
    "tasks": TASKS[:1],
    "zeta": 0.0,
    "participation": 0.5,
    "rounds": 8,
    "local_epochs": 3.0,
    "max_train_samples": 256,
    "output_dir": "runs/fedyolo_multitask",
}
CLIENTS_PER_TASK = 4
METHODS = {
    "fedyolo": {"strategy": "fedyolo"},
    "fedyolo_share_half": {"strategy": "fedyolo", "share": "half"},
    "modular_fedavg": {"strategy": "fedavg"},
    "full_fedavg": {"strategy": "fedavg", "peft_method": "full", "learning_rate": 5e-5},
}
SECURE = {"fedyolo_secure": {"strategy": "fedyolo", "secure_aggregation": True}}


def main(argv=None) -> int:
    parser = recipe_parser(__doc__.splitlines()[0], presets={})
    parser.add_argument("--tasks-order", nargs="+", default=TASKS,
                        help="task refs (builtin names, local paths, Hub ids): task 0 first, then the tasks to add")
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    args = parser.parse_args(argv)
    try:
        base = recipe_config(args, DEFAULTS, {})
        order = args.tasks_order
        settings = {f"{k}_tasks": {"tasks": order[:k], "num_clients": CLIENTS_PER_TASK * k}
                    for k in range(1, len(order) + 1)}
        methods = {m: METHODS[m] for m in args.methods}
        table = run_comparison(base, methods, settings)
        last = list(settings)[-1]
        table[last].update(run_comparison(base, SECURE, {last: settings[last]})[last])
        personal = _personalization(base, settings[last], last)
        names = list(next(iter(table[last].values()))["tasks"])  # task names, in the order of the refs
        report = write_report(base, table, names, personal)
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.read_text())
    print(f"report: {report}  (plot: task0_vs_tasks.png beside it)")
    publish_results(args, base.output_dir, report.read_text(), argv, __file__)
    return 0


def _personalization(base, setting: dict, name: str) -> dict:
    """Local-only, FedAvg and FedAvg+Local on the all-tasks modular FedAvg run (cached in a JSON file)."""
    run_dir = Path(base.output_dir) / name / "modular_fedavg"
    cache = run_dir / "personalization.json"
    if cache.exists():
        return json.loads(cache.read_text())
    method = dict(METHODS["modular_fedavg"])
    config = base.for_strategy(method.pop("strategy"), **method, **setting, output_dir=str(run_dir))
    if finished_results(config) is None:
        raise FedTaskError(f"{run_dir}: the modular FedAvg run is not finished")
    result = {"fedavg_local": personalize(run_dir, epochs=base.local_epochs), "local_only": local_only(config)}
    write_atomic(cache, json.dumps(result, indent=2) + "\n")
    return result


def _acc(results: dict, task: str) -> float:
    r = results["tasks"][task]
    return r[r["metric"]]


def write_report(base, table: dict, order: list[str], personal: dict) -> Path:
    out = Path(base.output_dir)
    settings = list(table)
    methods = [m for m in table[settings[0]]]
    task0 = order[0]
    lines = [f"# FedYolo multitask protocol: `{task0}` accuracy (%) as tasks are added", "",
             "| method | " + " | ".join(f"+{', '.join(order[1:k]) or 'alone'}" if k > 1 else "task 0 alone"
                                        for k in range(1, len(settings) + 1)) + " |",
             "|---|" + "---|" * len(settings)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(f"{100 * _acc(table[s][m], task0):.1f}" for s in settings) + " |")
    last = settings[-1]
    lines += ["", f"**All {len(order)} tasks: per-task accuracy (%) and communication per round**", "",
              "| method | " + " | ".join(order) + " | mean | uplink bytes / client / round | "
              "uplink params / client / round | T×M×P (uplink params, total) |",
              "|---|" + "---|" * (len(order) + 4)]
    for m, r in table[last].items():
        clients_per_round = max(1, int(np.ceil(r["config"]["participation"] * r["num_clients"] - 1e-9)))
        per_client = r["bytes_uplink"] / (r["rounds"] * clients_per_round)
        params = r["params_uplink"] / (r["rounds"] * clients_per_round)
        lines.append(f"| {m} | " + " | ".join(f"{100 * _acc(r, t):.1f}" for t in order)
                     + f" | **{100 * r['mean_metric']:.1f}** | {per_client:,.0f} | {params:,.0f} | "
                     f"{r['params_uplink']:,} |")
    rows = table[last]
    if "full_fedavg" in rows and "modular_fedavg" in rows:
        ratio = rows["full_fedavg"]["params_uplink"] / rows["modular_fedavg"]["params_uplink"]
        lines += ["", f"Full-update / modular FedAvg communication (parameters): **{ratio:.0f}×**."]
    if "fedyolo_secure" in rows and "fedyolo" in rows:
        growth = rows["fedyolo_secure"]["bytes_uplink"] / rows["fedyolo"]["bytes_uplink"]
        same = max(abs(_acc(rows["fedyolo_secure"], t) - _acc(rows["fedyolo"], t)) for t in order)
        lines += [f"Privacy variant (secure aggregation over all {len(order)} task slots, int64 masked): upload "
                  f"bytes **{growth:.1f}×** plain FedYolo's; largest per-task accuracy difference to plain "
                  f"FedYolo {100 * same:.2f} points."]
    fed, local = personal["fedavg_local"], personal["local_only"]
    lines += ["", "**Local-only vs FedAvg vs FedAvg+Local (modular FedAvg, all tasks; accuracy % on each task's "
              "global test split, personal models averaged over the task's clients)**", "",
              "| task | Local-only | FedAvg | FedAvg+Local | forgetting ratio |", "|---|---|---|---|---|"]
    for t in order:
        ratio = fed[t]["forgetting_ratio"]
        lines.append(f"| {t} | {100 * local[t][local[t]['metric']]:.1f} | {100 * fed[t]['before']:.1f} | "
                     f"{100 * fed[t]['after']:.1f} | {'–' if ratio is None else f'{ratio:.3f}'} |")
    mean = {k: np.mean(v) for k, v in {
        "local": [local[t][local[t]["metric"]] for t in order], "before": [fed[t]["before"] for t in order],
        "after": [fed[t]["after"] for t in order]}.items()}
    lines.append(f"| **mean** | {100 * mean['local']:.1f} | {100 * mean['before']:.1f} | {100 * mean['after']:.1f} | "
                 f"{(mean['before'] - mean['after']) / mean['before']:.3f} |")
    _plot(table, methods, settings, task0, out / "task0_vs_tasks.png")
    write_atomic(out / "fedyolo_multitask.json", json.dumps(
        {"task0": {m: [_acc(table[s][m], task0) for s in settings] for m in methods},
         "all_tasks": {m: {t: _acc(r, t) for t in order} for m, r in rows.items()},
         "personalization": personal}, indent=2) + "\n")
    path = out / "fedyolo_multitask.md"
    write_atomic(path, "\n".join(lines) + "\n")
    return path


def _plot(table: dict, methods: list[str], settings: list[str], task0: str, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ks = list(range(1, len(settings) + 1))
    for i, m in enumerate(methods):
        ax.plot(ks, [100 * _acc(table[s][m], task0) for s in settings], marker="o", color=f"C{i}", label=m)
    ax.set_xticks(ks)
    ax.set_xlabel("number of tasks in the federation")
    ax.set_ylabel(f"{task0} test accuracy (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
