"""Client-level differential privacy on builtin-8: FedAvg and MaTU test accuracy at ε ∈ {1, 4, 16, ∞} (δ = 1e-5).

    python recipes/dp_table.py                          # builtin-8, MiniLM + LoRA, CPU: 10 runs
    python recipes/dp_table.py --quick                  # a smoke test: 2 ε, 2 rounds, fewer clients and samples
    python recipes/dp_table.py --epsilons 8 inf         # other budgets ("inf": clipping without noise)
    python recipes/dp_table.py --methods fedavg         # one method
    python recipes/dp_table.py --dp-clip 0.5            # any RunConfig key is a flag

The protocol: builtin-8's 400 training samples per task split over 8 single-task clients each (64 clients of
50 samples), every client taking part in every round (so the accounting needs no assumption about the
sampling), a head per task, 4 rounds of 1 local epoch, LoRA r = 4. For each finite ε the noise multiplier σ is
calibrated by dp-accounting before training (`hf_fedtask.privacy.accountant`: RDP, replace-one adjacency, the
sums moving by up to 2C when one client's data is replaced); "∞" is the same mechanism (clipping to C, uniform
weights) without noise, and "no DP" the run without any of it. Beside the guarantee the table gives ε under
add/remove adjacency for the same noise (the convention of opacus' accountant: sensitivity C) and the noise's
norm on FedAvg's mean update each round in units of C, σ·√d/N for d uploaded parameters and N clients: above 1
the noise outweighs any client's whole (clipped) update. Writes `<output_dir>/dp_table.md`, `dp_table.json`,
`dp_table.png` and every run under `<output_dir>/<method>/<column>/`; rerunning reuses finished runs.
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
from hf_fedtask.workflows.recipe import publish_results, recipe_config, recipe_parser, resource_report  # noqa: E402

DEFAULTS = {
    "suite": "builtin-8",
    "num_clients": 64,
    "zeta": 0.0,
    "participation": 1.0,
    "max_test_samples": 100,
    "rounds": 4,
    "local_epochs": 1.0,
    "batch_size": 16,
    "lora_r": 4,
    "dp_clip": 1.0,
    "dp_delta": 1e-5,
    "export": False,
    "output_dir": "runs/dp_table",
}
QUICK = {"num_clients": 16, "rounds": 2, "max_train_samples": 64, "max_test_samples": 32, "min_samples": 4}
METHODS = {"fedavg": {"strategy": "fedavg"}, "matu": {"strategy": "matu"}}
EPSILONS = ["1", "4", "16", "inf"]
NO_DP = "no DP"  # the column of runs without clipping or noise


def _epsilon(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"ε must be positive or inf, got {text}")
    return value


def run_cell(base: RunConfig, method: str, eps: float | str, resume: bool) -> dict:
    """One run: `method` at target ε (∞: clipping without noise; NO_DP: neither), in its own folder."""
    from hf_fedtask.engine.run import run

    column = "no_dp" if eps == NO_DP else f"eps_{'inf' if math.isinf(eps) else f'{eps:g}'}"
    folder = Path(base.output_dir) / method / column
    if eps == NO_DP:
        dp = {"dp_clip": None}
    else:
        dp = {"dp_noise_multiplier": 0.0} if math.isinf(eps) else {"dp_epsilon": eps}
    values = {k: v for k, v in base.to_dict().items() if k not in ("dp_noise_multiplier", "dp_epsilon")}
    config = RunConfig.from_dict({**values, "strategy_options": {}, **METHODS[method], **dp,
                                  "output_dir": str(folder)})
    results_file = folder / "results.json"
    if resume and results_file.exists():
        return json.loads(results_file.read_text())
    return run(config, resume=resume and (folder / "checkpoint.safetensors").exists(), overwrite=not resume)


def uploaded_parameters(folder: Path) -> int:
    """Parameters one client uploads per round (the first round's uplink over its clients)."""
    first = json.loads((folder / "metrics.jsonl").read_text().splitlines()[0])
    from hf_fedtask.privacy.report import round_clients

    return round(first["params_uplink"] / len(round_clients(first)))


def add_remove_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """ε of the same noise under add/remove adjacency (sensitivity C, opacus' convention), full participation:
    dp-accounting's RDP accountant on `rounds` Gaussian mechanisms of noise multiplier σ."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)
    return float(accountant.get_epsilon(delta))


def _label(column) -> str:
    return column if column == NO_DP else ("ε = ∞" if math.isinf(column) else f"ε = {column:g}")


def _key(column) -> str:
    """The column's key in dp_table.json: no_dp, inf, or the target ε."""
    return "no_dp" if column == NO_DP else ("inf" if math.isinf(column) else f"{column:g}")


def write_table(cells: dict, base: RunConfig, columns: list, seconds: float) -> Path:
    """dp_table.md (accuracy %, σ, ε under both adjacencies, noise / C, clipped share), .json and .png beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(base.output_dir)
    labels = [_label(c) for c in columns]
    first = next(iter(cells))
    lines = ["| method | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for method, row in cells.items():
        lines.append(f"| {method} | " + " | ".join(f"{100 * row[c]['mean_metric']:.1f}" for c in columns) + " |")
    noised = [c for c in columns if c != NO_DP and not math.isinf(c)]
    sigma = {c: cells[first][c]["privacy"]["noise_multiplier"] for c in noised}
    spent = {c: cells[first][c]["privacy"]["epsilon"] for c in noised}
    d = uploaded_parameters(Path(base.output_dir) / first / f"eps_{noised[0]:g}") if noised else None
    n = max(1, math.ceil(base.participation * base.num_clients - 1e-9))

    # the add/remove figure is for full participation only (every client in every round, no sampling to model)
    add_remove = ({c: add_remove_epsilon(sigma[c], base.rounds, base.dp_delta) for c in noised}
                  if n == base.num_clients else {})

    def row(name, values):
        return f"| {name} | " + " | ".join(values.get(c, "–") for c in columns) + " |"

    lines += ["", "| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels),
              row("noise multiplier σ (calibrated)", {c: f"{sigma[c]:.3g}" for c in noised}),
              row("ε spent (replace-one: the guarantee)", {c: f"{spent[c]:.3g}" for c in noised}),
              row("ε of the same noise under add/remove (full participation)",
                  {c: f"{add_remove[c]:.3g}" for c in add_remove}),
              row(f"noise norm on FedAvg's mean / C (σ·√d/N, d = {d:,})" if d else "noise norm / C",
                  {c: f"{sigma[c] * math.sqrt(d) / n:.2f}" for c in noised} if d else {})]
    for method, r in cells.items():
        lines.append(row(f"{method}: share of uploads clipped",
                         {c: f"{r[c]['privacy']['mean_clipped_fraction']:.2f}" for c in columns if c != NO_DP}))
    chance = cells[first][columns[0]]["tasks"]
    chance_mean = sum(t["chance"] for t in chance.values()) / len(chance)
    note = (f"builtin-8 mean test accuracy (%), {base.base_model_id or base.base_model} + {base.peft_method} "
            f"r={base.lora_r}, a head per task; {base.num_clients} single-task clients, {n} per round; "
            f"{base.rounds} rounds × {base.local_epochs:g} local epoch(s), batch "
            f"{base.batch_size}, lr {base.learning_rate}; {base.max_train_samples or 'all'} training / "
            f"{base.max_test_samples or 'all'} test samples per task. Client-level DP: each client's whole upload "
            f"clipped to C = {base.dp_clip}, Gaussian noise σ·C on every aggregated sum (on the server), σ "
            f"calibrated by dp-accounting (RDP, replace-one adjacency) to each ε at δ = {base.dp_delta:g}; ε = ∞: "
            f"the same clipping and uniform weights without noise; no DP: neither. Chance: {100 * chance_mean:.1f}%. "
            f"Seed {base.seed}; {seconds / 60:.1f} min in all.")
    (out / "dp_table.md").write_text("\n".join(lines) + "\n\n" + note + "\n")
    (out / "dp_table.json").write_text(json.dumps(
        {m: {_key(c): {"mean_metric": r[c]["mean_metric"], "privacy": r[c].get("privacy"),
                         "tasks": {t: v[v["metric"]] for t, v in r[c]["tasks"].items()}}
             for c in columns} for m, r in cells.items()}, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for method, r in cells.items():
        ax.plot(range(len(columns)), [100 * r[c]["mean_metric"] for c in columns], marker="o", label=method)
    ax.axhline(100 * chance_mean, color="grey", linestyle=":", label="chance")
    ax.set_xticks(range(len(columns)), labels)
    ax.set_xlabel(f"privacy (δ = {base.dp_delta:g})")
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
            epsilons = sorted({_epsilon(e) for e in (["4", "inf"] if args.quick else args.epsilons)}, reverse=True)
        except ValueError as e:
            print(f"error: --epsilons: {e}", file=sys.stderr)
            return 2
        base = recipe_config(args, {**DEFAULTS, **(QUICK if args.quick else {})}, {})
        columns = [NO_DP, *epsilons]
        cells = {m: {} for m in args.methods}
        for method, column in tqdm([(m, c) for m in args.methods for c in columns], desc="dp table"):
            cells[method][column] = run_cell(base, method, column, resume=not args.overwrite)
        path = write_table(cells, base, columns, time.perf_counter() - start)
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path.read_text())
    print(f"tables: {path}  (and {path.with_suffix('.json')}, {path.with_suffix('.png')})")
    print(resource_report(time.perf_counter() - start))
    publish_results(args, base.output_dir, path.read_text(), argv, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
