"""TCT beyond the paper: the same strategy on the builtin text suite with MiniLM + LoRA (eNTK over the
LoRA and head parameters), against FedAvg, under task skew and under label skew.

    python recipes/tct_text.py                              # both settings, p = 2,000 and 10,000
    python recipes/tct_text.py --settings labels --tct-features 10000
    python recipes/tct_text.py --max-train-samples 256      # any RunConfig key is a flag

Settings: `tasks` = builtin-8, one client per task (task skew only); `labels` = builtin-8, three
clients per task with a Dirichlet α = 0.1 label split (task and label skew). FedAvg trains LoRA for
all rounds; TCT runs `--tct-stage1` of the same FedAvg rounds, one normalization round, then stage 2
until the same number of rounds. Writes `<output_dir>/tct_text.md` (mean test accuracy % and what
TCT costs: seconds of a stage-1 round, of the feature round, of a stage-2 round, and a task's
training features in MB), `tct_text.json` and `tct_text.png`. Rerunning resumes finished runs.
"""

import json
import os
import statistics
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
    "suite": "builtin-8",
    "rounds": 10,
    "max_train_samples": 512,
    "max_test_samples": 400,
    "local_epochs": 1.0,
    "export": False,
    "output_dir": "runs/tct_text",
}
SETTINGS = {"tasks": ("task skew: 8 clients, one task each", {"num_clients": 8, "partition": "iid"}),
            "labels": ("task + label skew: 24 clients, 3 per task, α=0.1",
                       {"num_clients": 24, "partition": "dirichlet", "alpha": 0.1})}


def methods(args) -> dict[str, dict]:
    out = {"fedavg": {"strategy": "fedavg"}}
    for p in args.tct_features:
        out[f"tct_p{p}"] = {"strategy": "tct", "stage1_rounds": args.tct_stage1, "num_features": p,
                            "stage2_steps": args.tct_steps}
    return out


def costs(rows: list[dict], stage1: int, p: int, samples: int) -> dict:
    """Seconds of a stage-1, the feature (query) and a stage-2 round, and the float32 features of
    `samples` samples (a client holds at most one task's training split here)."""
    query = [r for r in rows if r.get("kind") == "query"]
    return {"stage1_s": statistics.median(r["seconds"] for r in rows[:stage1]),
            "features_s": query[0]["seconds"] if query else None,
            "stage2_s": statistics.median(r["seconds"] for r in rows[stage1 + 1:]) if len(rows) > stage1 + 1 else None,
            "features_mb": 4 * p * samples / 1e6}


def main(argv=None) -> int:
    parser = recipe_parser(__doc__.splitlines()[0], {})
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--tct-stage1", type=int, default=6, help="TCT's T₁ (FedAvg rounds)")
    parser.add_argument("--tct-features", type=int, nargs="+", default=[2000, 10000],
                        help="TCT's p (eNTK coordinates), one TCT run per value")
    parser.add_argument("--tct-steps", type=int, default=100, help="TCT's M (local steps of stage 2)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        base = recipe_config(args, DEFAULTS, {})
        settings = {key: SETTINGS[key][1] for key in args.settings}
        table = run_comparison(base, methods(args), settings)
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(base.output_dir)
    names = list(methods(args))
    acc = {s: {m: 100 * table[s][m]["mean_metric"] for m in names} for s in settings}
    per_round = {s: {m: mean_curve(read_history(out / s / m)) for m in names} for s in settings}
    cost = {}
    for s in settings:
        for m in names[1:]:
            cost[f"{s}/{m}"] = costs(read_history(out / s / m), args.tct_stage1, int(m.split("_p")[1]),
                                     base.max_train_samples or 0)
    fedavg_round = {s: statistics.median(r["seconds"] for r in read_history(out / s / "fedavg")) for s in settings}
    lines = [f"**builtin-8, MiniLM + LoRA r={base.lora_r}, {base.rounds} rounds, {base.max_train_samples} training "
             f"samples per task, mean test accuracy % after the last round; TCT: T₁ = {args.tct_stage1}, "
             f"M = {args.tct_steps}**", "",
             "| setting | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in settings:
        lines.append(f"| {SETTINGS[s][0]} | " + " | ".join(f"{acc[s][m]:.1f}" for m in names) + " |")
    lines += ["", "| setting / method | FedAvg round (s) | stage-1 round (s) | feature round (s) | stage-2 round (s) "
              "| one task's training features (MB) |", "|---|---|---|---|---|---|"]
    for key, c in cost.items():
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        lines.append(f"| {key} | {fedavg_round[key.split('/')[0]]:.1f} | {fmt(c['stage1_s'])} | {fmt(c['features_s'])} "
                     f"| {fmt(c['stage2_s'])} | {c['features_mb']:.1f} |")
    text = "\n".join(lines) + "\n"
    write_atomic(out / "tct_text.md", text)
    write_atomic(out / "tct_text.json", json.dumps({"final": acc, "per_round": per_round, "costs": cost,
                                                    "fedavg_round_s": fedavg_round}, indent=1) + "\n")
    plot_curves_by_setting(per_round, {k: SETTINGS[k][0] for k in settings}, out / "tct_text.png",
                           ylabel="mean test accuracy (%)")
    print(text)
    print(resource_report(time.perf_counter() - start))
    publish_results(args, out, text, argv, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
