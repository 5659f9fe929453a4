"""TCT's Table 2 on Fashion-MNIST at this machine's scale: FedAvg, FedProx, SCAFFOLD, TCT and a
centralized reference, 10 clients, label skew #C=1, #C=2, Dirichlet α=0.1 and α=0.5 (NIID-Bench).

    apt-get install dataset-fashion-mnist          # the data, offline (or the Hub copy, online)
    python recipes/tct_fmnist.py                   # the whole table
    python recipes/tct_fmnist.py --settings c1     # one column; any RunConfig key is a flag
    python recipes/tct_fmnist.py --tct-stage1 20 --tct-features 10000 --tct-steps 100
    python recipes/tct_fmnist.py --ablation-steps 1 10 100   # + stage 2 with SCAFFOLD vs FedAvg over M
    python recipes/tct_fmnist.py --methods fedavg tct --settings c1 a05   # two methods, two columns

A small CNN (`hf-fedtask/small-cnn`, trained in full) with SGD; every client every round; TCT runs
`--tct-stage1` FedAvg rounds, the normalization round, then stage 2 until the same total number of
rounds as the baselines. Writes `<output_dir>/tct_fmnist.md` (final test accuracy %, methods by
split), `tct_fmnist.json` and `tct_fmnist.png` (accuracy per round), and every run under
`<output_dir>/<split>/<method>/`. Rerunning resumes finished runs from their folders.

`--ablation-steps` adds TCT runs whose stage 2 uses the SCAFFOLD-corrected update (TCT's) or plain
FedAvg of local full-batch steps, for each M, and a second table (`tct_fmnist_ablation.md`).
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from hf_fedtask.core.files import write_atomic  # noqa: E402
from hf_fedtask.engine.run_folder import read_history  # noqa: E402
from hf_fedtask.errors import FedTaskError  # noqa: E402
from hf_fedtask.report import mean_curve, plot_curves_by_setting  # noqa: E402
from hf_fedtask.workflows.compare import run_comparison  # noqa: E402
from hf_fedtask.workflows.recipe import publish_results, recipe_config, recipe_parser, resource_report  # noqa: E402

DEFAULTS = {
    "tasks": ["fashion_mnist"],
    "suite": None,
    "base_model": "hf-fedtask/small-cnn",
    "peft_method": "full",
    "num_clients": 10,
    "participation": 1.0,
    "rounds": 30,
    "max_train_samples": 5000,  # 500 per client on average
    "max_test_samples": 2000,
    "local_epochs": 1.0,
    "batch_size": 32,
    "optimizer": "sgd",
    "learning_rate": 0.05,
    "lr_scheduler": "constant",
    "min_samples": 10,
    "export": False,
    "output_dir": "runs/tct_fmnist",
}
SPLITS = {"c1": ("#C=1", {"partition": "classes", "classes_per_client": 1}),
          "c2": ("#C=2", {"partition": "classes", "classes_per_client": 2}),
          "a01": ("α=0.1", {"partition": "dirichlet", "alpha": 0.1}),
          "a05": ("α=0.5", {"partition": "dirichlet", "alpha": 0.5})}
PAPER = {"fedavg": "35.1 / 85.2 / 86.2 / 90.1", "fedprox": "50.0 / 84.9 / 86.3 / 89.8",
         "scaffold": "12.8 / 42.8 / 83.9 / 89.4", "tct": "86.3 / 90.3 / 90.8 / 91.1", "central": "91.4"}


METHODS = ("fedavg", "fedprox", "scaffold", "tct", "central")


def methods(args) -> dict[str, dict]:
    tct = {"strategy": "tct", "stage1_rounds": args.tct_stage1, "num_features": args.tct_features,
           "stage2_steps": args.tct_steps}
    every = {"fedavg": {"strategy": "fedavg"}, "fedprox": {"strategy": "fedprox"},
             "scaffold": {"strategy": "scaffold"}, "tct": tct}
    return {**{m: every[m] for m in every if m in args.methods}, **ablation(args)}


def ablation(args) -> dict[str, dict]:
    """TCT with stage-2 solver s and M local steps, as `tct_<s>_M<M>`."""
    return {f"tct_{solver}_M{m}": {"strategy": "tct", "stage1_rounds": args.tct_stage1,
                                   "num_features": args.tct_features, "stage2_steps": m, "solver": solver}
            for m in args.ablation_steps for solver in ("scaffold", "fedavg")}


def ablation_table(acc: dict, args, splits: dict) -> str:
    header = " | ".join(f"{SPLITS[s][0]} {solver}" for s in splits for solver in ("scaffold", "fedavg"))
    lines = ["**TCT's stage 2: SCAFFOLD-corrected vs plain FedAvg local steps, test accuracy % after the last "
             "round, by M (local full-batch steps per round)**", "", f"| M | {header} |",
             "|---|" + "---|" * 2 * len(splits)]
    for m in args.ablation_steps:
        lines.append(f"| {m} | " + " | ".join(f"{acc[f'tct_{solver}_M{m}'][s]:.1f}" for s in splits
                                              for solver in ("scaffold", "fedavg")) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = recipe_parser(__doc__.splitlines()[0], {})
    parser.add_argument("--settings", nargs="+", choices=sorted(SPLITS), default=list(SPLITS))
    parser.add_argument("--tct-stage1", type=int, default=20, help="TCT's T₁ (FedAvg rounds)")
    parser.add_argument("--tct-features", type=int, default=10000, help="TCT's p (eNTK coordinates)")
    parser.add_argument("--tct-steps", type=int, default=100, help="TCT's M (local steps of stage 2)")
    parser.add_argument("--ablation-steps", type=int, nargs="*", default=[],
                        help="also run TCT with a SCAFFOLD and a FedAvg stage 2 for each of these M")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="the table's rows (central: one client holding all the data)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        base = recipe_config(args, DEFAULTS, {})
        splits = {key: SPLITS[key][1] for key in args.settings}
        table = run_comparison(base, methods(args), splits)
        central = (run_comparison(base, {"central": {"strategy": "fedavg", "num_clients": 1, "partition": "iid"}},
                                  {"central": {}})["central"]["central"] if "central" in args.methods else None)
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(base.output_dir)
    names = [m for m in methods(args) if m not in ablation(args)]
    acc = {m: {s: 100 * table[s][m]["mean_metric"] for s in splits} for m in methods(args)}
    header = " | ".join(SPLITS[s][0] for s in splits)
    lines = [f"**{', '.join(base.tasks or [])}, {base.num_clients} clients, {base.rounds} rounds, "
             f"test accuracy % after the last "
             f"round** (paper, Table 2: #C=1 / #C=2 / α=0.1 / α=0.5)", "",
             f"| method | {header} | paper |", "|---|" + "---|" * len(splits) + "---|"]
    for m in names:
        lines.append(f"| {m} | " + " | ".join(f"{acc[m][s]:.1f}" for s in splits) + f" | {PAPER[m]} |")
    if central is not None:
        lines.append(f"| centralized | {100 * central['mean_metric']:.1f} (one client, all data) |"
                     + " |" * (len(splits) - 1) + f" {PAPER['central']} |")
    text = "\n".join(lines) + "\n"
    write_atomic(out / "tct_fmnist.md", text)
    if args.ablation_steps:
        text += "\n" + ablation_table(acc, args, splits)
        write_atomic(out / "tct_fmnist_ablation.md", ablation_table(acc, args, splits))
    per_round = {s: {m: mean_curve(read_history(out / s / m)) for m in names} for s in splits}
    write_atomic(out / "tct_fmnist.json", json.dumps({"final": acc, "central": None if central is None
                                                      else 100 * central["mean_metric"],
                                                      "per_round": per_round}, indent=1) + "\n")
    plot_curves_by_setting(per_round, {k: SPLITS[k][0] for k in splits}, out / "tct_fmnist.png")
    print(text)
    print(resource_report(time.perf_counter() - start))
    publish_results(args, out, text, argv, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
