"""Client-level differential privacy on builtin-8: FedAvg and MaTU test accuracy at ε ∈ {1, 4, 16, ∞} (δ = 1e-5).

    python recipes/dp_table.py                          # builtin-8, MiniLM + LoRA, CPU: 8 runs, about 25 min
    python recipes/dp_table.py --quick                  # a smoke test: 2 ε, 3 rounds, fewer samples
    python recipes/dp_table.py --epsilons 8 inf         # other budgets ("inf": clipping without noise)
    python recipes/dp_table.py --methods fedavg         # one method
    python recipes/dp_table.py --dp-clip 0.05           # any RunConfig key is a flag

The protocol (chosen to fit about 25 minutes on 2 CPU cores, and to give DP a chance): 200 training samples
per task split over 128 single-task clients (16 per task, about 12 samples each), an eighth of them sampled
each round (8 clients), one classification head shared by all tasks (`output_space: max`, so every sampled
client contributes to it), 10 rounds of 2 local epochs. Many small clients with partial participation is what
client-level DP needs: sampling m of N amplifies privacy, so for a given ε the noise on a mean of m uploads
falls roughly as 1/N at the same computation per round (m clients' data), which is what bounds the table's
time here. For each finite ε the noise multiplier σ is calibrated by dp-accounting
before training (sampling without replacement, replace-one adjacency; `hf_fedtask.privacy.accountant`);
ε = ∞ is the same mechanism (clipping, uniform weights) without noise. Writes `<output_dir>/dp_table.md`,
`dp_table.json`, `dp_table.png` and every run under `<output_dir>/<method>/eps_<ε>/`; rerunning resumes.
"""

import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from tqdm.auto import tqdm  # noqa: E402

from hf_fedtask.config import RunConfig  # noqa: E402
from hf_fedtask.errors import FedTaskError  # noqa: E402
from hf_fedtask.workflows.recipe import recipe_config, recipe_parser, resource_report  # noqa: E402

DEFAULTS = {
    "suite": "builtin-8",
    "output_space": "max",
    "num_clients": 128,
    "zeta": 0.0,
    "participation": 0.0625,
    "max_train_samples": 200,
    "max_test_samples": 100,
    "rounds": 10,
    "local_epochs": 2.0,
    "batch_size": 16,
    "lora_r": 4,
    "eval_every": 5,
    "dp_clip": 1.0,
    "dp_delta": 1e-5,
    "export": False,
    "output_dir": "runs/dp_table",
}
QUICK = {"num_clients": 32, "rounds": 3, "max_train_samples": 64, "max_test_samples": 32, "eval_every": 3,
         "min_samples": 4}
METHODS = {"fedavg": {"strategy": "fedavg"}, "matu": {"strategy": "matu"}}
EPSILONS = ["1", "4", "16", "inf"]


def _epsilon(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"ε must be positive or inf, got {text}")
    return value


def run_cell(base: RunConfig, method: str, eps: float, resume: bool) -> dict:
    """One run: `method` at target ε (∞: no noise), in its own folder."""
    from hf_fedtask.engine.run import run

    folder = Path(base.output_dir) / method / f"eps_{'inf' if math.isinf(eps) else f'{eps:g}'}"
    dp = {"dp_noise_multiplier": 0.0} if math.isinf(eps) else {"dp_epsilon": eps}
    values = {k: v for k, v in base.to_dict().items() if k not in ("dp_noise_multiplier", "dp_epsilon")}
    config = RunConfig.from_dict({**values, "strategy_options": {}, **METHODS[method], **dp,
                                  "output_dir": str(folder)})
    results_file = folder / "results.json"
    if resume and results_file.exists():
        return json.loads(results_file.read_text())
    return run(config, resume=resume and (folder / "checkpoint.safetensors").exists(), overwrite=not resume)


def write_table(cells: dict, base: RunConfig, epsilons: list[float], seconds: float) -> Path:
    """dp_table.md (accuracy %, σ, clipped share per method and ε), .json and .png beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(base.output_dir)
    labels = ["∞" if math.isinf(e) else f"{e:g}" for e in epsilons]
    lines = ["| method | " + " | ".join(f"ε = {label}" for label in labels) + " |",
             "|---|" + "---|" * len(labels)]
    for method, row in cells.items():
        lines.append(f"| {method} | " + " | ".join(f"{100 * row[e]['mean_metric']:.1f}" for e in epsilons) + " |")
    sigma = {e: next(iter(cells.values()))[e]["privacy"]["noise_multiplier"] for e in epsilons}
    lines += ["", "| noise multiplier σ (calibrated) | " + " | ".join(f"{sigma[e]:.3g}" for e in epsilons) + " |",
              "|---|" + "---|" * len(labels)]
    for method, row in cells.items():
        lines.append(f"| {method}: share of uploads clipped | "
                     + " | ".join(f"{row[e]['privacy']['mean_clipped_fraction']:.2f}" for e in epsilons) + " |")
    chance = next(iter(cells.values()))[epsilons[0]]["tasks"]
    chance_mean = sum(t["chance"] for t in chance.values()) / len(chance)
    sample = max(1, math.ceil(base.participation * base.num_clients - 1e-9))
    note = (f"builtin-8 mean test accuracy (%), {base.base_model_id or base.base_model} + {base.peft_method} "
            f"r={base.lora_r}, output space `{base.output_space}`; {base.num_clients} single-task clients, {sample} "
            f"sampled per round without replacement; {base.rounds} rounds × {base.local_epochs} local epoch(s), batch "
            f"{base.batch_size}, lr {base.learning_rate}; {base.max_train_samples or 'all'} training / "
            f"{base.max_test_samples or 'all'} test samples per task. Client-level DP: each client's whole upload "
            f"clipped to C = {base.dp_clip}, Gaussian noise σ·C on every aggregated sum (server), σ calibrated by "
            f"dp-accounting (RDP, sampling without replacement, replace-one adjacency) to each ε at δ = "
            f"{base.dp_delta:g}; ε = ∞: the same clipping and uniform weights without noise. Chance: "
            f"{100 * chance_mean:.1f}%. Seed {base.seed}; {seconds / 60:.1f} min in all.")
    (out / "dp_table.md").write_text("\n".join(lines) + "\n\n" + note + "\n")
    (out / "dp_table.json").write_text(json.dumps(
        {m: {("inf" if math.isinf(e) else f"{e:g}"): {"mean_metric": r[e]["mean_metric"], "privacy": r[e]["privacy"],
                                                      "tasks": {t: v[v["metric"]] for t, v in r[e]["tasks"].items()}}
             for e in epsilons} for m, r in cells.items()}, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method, row in cells.items():
        ax.plot(range(len(epsilons)), [100 * row[e]["mean_metric"] for e in epsilons], marker="o", label=method)
    ax.axhline(100 * chance_mean, color="grey", linestyle=":", label="chance")
    ax.set_xticks(range(len(epsilons)), labels)
    ax.set_xlabel(f"ε (δ = {base.dp_delta:g})")
    ax.set_ylabel("mean test accuracy %")
    ax.set_title("client-level DP on builtin-8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "dp_table.png", dpi=120)
    plt.close(fig)
    return out / "dp_table.md"


def main(argv=None) -> int:
    parser = recipe_parser(__doc__.splitlines()[0], {})
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--epsilons", nargs="+", default=EPSILONS, help="target ε values; inf: no noise")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 ε, 3 rounds, fewer samples")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        try:
            epsilons = sorted({_epsilon(e) for e in (["4", "inf"] if args.quick else args.epsilons)})
        except ValueError as e:
            print(f"error: --epsilons: {e}", file=sys.stderr)
            return 2
        base = recipe_config(args, {**DEFAULTS, **(QUICK if args.quick else {})}, {})
        cells = {m: {} for m in args.methods}
        for method, eps in tqdm([(m, e) for m in args.methods for e in epsilons], desc="dp table"):
            cells[method][eps] = run_cell(base, method, eps, resume=not args.overwrite)
        path = write_table(cells, base, epsilons, time.perf_counter() - start)
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path.read_text())
    print(f"tables: {path}  (and {path.with_suffix('.json')}, {path.with_suffix('.png')})")
    print(resource_report(time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
