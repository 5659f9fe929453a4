"""Clients of different LoRA ranks (`lora_ranks`, FlexLoRA) against every client at one rank, on MiniLM (builtin
tasks) or, with `--llm`, on the LLM recipe's protocol (SmolLM2-135M-Instruct, `recipes/llm_manytask.py`).

Arms (FedAvg with `lora_aggregation: product`, the same runs but for the ranks; α = 2·lora_r in each, so that the
scaling α/r, the size of one unit of a factor in ΔW, is the same 2 in every arm and for every client):

    uniform_r8    every client at rank 8 (`lora_ranks: [8]`, the uniform product run exactly, recorded with its
                  spectrum; tests/test_hetero_lora.py checks the two are the same run)
    ranks_4_8_16  client c at rank (4, 8, 16)[c mod 3], the server at lora_r 16: each client receives the global
                  product truncated to its rank and the server re-factorizes the mean of the clients' products
    uniform_r4    (`--arms`) every client at rank 4: what a federation does when its smallest client decides

The table: mean accuracy over the tasks (mean ± std over `--seeds`), per round the spectrum of the aggregate M
(`metrics.jsonl`'s `aggregation`): its effective rank (exp of the entropy of σ/Σσ) and the singular values holding
99% of its energy, means over the LoRA modules, and the truncation residual ‖M − M_r‖/‖M‖ at each client rank
(at r = 4 it says how much of the update a rank-4 client never receives); and the bytes per round (both
directions). `RATIO ranks_4_8_16/uniform_r8 mean accuracy = X` is printed for scripts.

    python benchmarks/hetero_lora.py                   # MiniLM, builtin-8, 2 seeds: 6 min of CPU at
                                                       # OMP_NUM_THREADS=1 (16 min on a 2-core box at load 6-9)
    python benchmarks/hetero_lora.py --quick           # 2 tasks, 2 rounds, 1 seed: a smoke run
    python benchmarks/hetero_lora.py --llm --seeds 0   # the LLM recipe's protocol on SmolLM2: 18 min of CPU
                                                       # (32 min on a 2-core box at load 5)
    python benchmarks/hetero_lora.py --results-page docs/results/lora_ranks.md

Any RunConfig key is a flag (`--rounds 8`, `--num-clients 6`); reruns reuse finished runs under
`<output_dir>/seed<k>/<arm>/`. Writes `<output_dir>/comparison.md` and `comparison.json`.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from hf_fedtask.core.files import write_atomic  # noqa: E402
from hf_fedtask.errors import FedTaskError  # noqa: E402
from hf_fedtask.workflows.compare import run_seeds  # noqa: E402
from hf_fedtask.workflows.recipe import publish_results, recipe_config, recipe_parser, resource_report  # noqa: E402

MINILM = {  # builtin-8, each client holding some of the tasks (ζ = 0.5), every client every round
    "suite": "builtin-8",
    "num_clients": 6,
    "zeta": 0.5,
    "participation": 1.0,
    "rounds": 6,
    "eval_every": 6,
    "local_steps": 8,
    "batch_size": 16,
    "learning_rate": 5e-3,
    "max_length": 32,
    "max_train_samples": 200,
    "max_test_samples": 100,
    "output_dir": "runs/hetero_lora",
}
QUICK = {"suite": None, "tasks": ["vader_polarity", "first_name_gender"], "num_clients": 3, "rounds": 2,
         "eval_every": 1, "local_steps": 2, "max_train_samples": 48, "max_test_samples": 32,
         "output_dir": "runs/hetero_lora_quick"}
PRODUCT = {"strategy": "fedavg", "lora_aggregation": "product"}
ARMS = {
    "uniform_r8": {**PRODUCT, "lora_r": 8, "lora_alpha": 16, "lora_ranks": [8]},
    "ranks_4_8_16": {**PRODUCT, "lora_r": 16, "lora_alpha": 32, "lora_ranks": [4, 8, 16]},
    "uniform_r4": {**PRODUCT, "lora_r": 4, "lora_alpha": 8, "lora_ranks": [4]},
}
DEFAULT_ARMS = ["uniform_r8", "ranks_4_8_16"]
REFERENCE, HETERO = "uniform_r8", "ranks_4_8_16"
RANKS = (4, 8, 16)


def llm_protocol() -> dict:
    """The LLM recipe's settings (`recipes/llm_manytask.py`'s DEFAULTS), read from the recipe itself."""
    path = Path(__file__).resolve().parents[1] / "recipes" / "llm_manytask.py"
    spec = importlib.util.spec_from_file_location("llm_manytask", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {**module.DEFAULTS, "output_dir": "runs/hetero_lora_llm"}


def spectrum(run_dir: Path) -> dict[str, list[float]]:
    """Per round, what the aggregation recorded: effective rank, 99%-energy rank, residual at each rank."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out: dict[str, list[float]] = {"effective_rank": [], "rank_99": [], **{f"residual_{r}": [] for r in RANKS}}
    for record in records:
        d = record["aggregation"]
        out["effective_rank"].append(d["lora_effective_rank"])
        out["rank_99"].append(d["lora_rank_99"])
        for r in RANKS:  # None: not one of the run's ranks (not recorded)
            out[f"residual_{r}"].append(d["lora_rank_residuals"].get(str(r)))
    return out


def _mean(values: list) -> float | None:
    return None if any(v is None for v in values) else float(np.mean(values))


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def rows_of(results: dict[str, list[dict]], run_dirs: dict[str, list[Path]]) -> list[dict]:
    rows = []
    for arm, runs in results.items():
        means = [r["mean_metric"] for r in runs]
        spectra = [spectrum(d) for d in run_dirs[arm]]
        per_round = {k: [_mean(values) for values in zip(*(s[k] for s in spectra))] for k in spectra[0]}
        tasks = list(runs[0]["tasks"])
        rows.append({"arm": arm, "seeds": len(runs), "mean": float(np.mean(means)),
                     "mean_std": float(np.std(means)) if len(means) > 1 else None,
                     "per_seed": means,
                     "tasks": {t: float(np.mean([r["tasks"][t][r["tasks"][t]["metric"]] for r in runs]))
                               for t in tasks},
                     "bytes_per_round": float(np.mean([(r["bytes_uplink"] + r["bytes_downlink"]) / r["rounds"]
                                                       for r in runs])),
                     "per_round": per_round})
    return rows


def markdown(rows: list[dict], note: str) -> str:
    lines = [note, "", "| arm | mean accuracy | per seed | kB/round | effective rank (last round) | 99%-energy rank "
             "| residual at r=4 / 8 / 16 (last round) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        p = row["per_round"]
        std = f" ± {100 * row['mean_std']:.1f}" if row["mean_std"] is not None else ""
        residuals = " / ".join(_fmt(p[f"residual_{r}"][-1]) for r in RANKS)
        lines.append(f"| {row['arm']} | **{100 * row['mean']:.1f}{std}** | "
                     + ", ".join(f"{100 * v:.1f}" for v in row["per_seed"])
                     + f" | {row['bytes_per_round'] / 1e3:.0f} | {p['effective_rank'][-1]:.2f} | {p['rank_99'][-1]:.2f}"
                     f" | {residuals} |")
    for row in rows:
        p = row["per_round"]
        lines.append(f"\n{row['arm']} per round: effective rank "
                     + ", ".join(_fmt(v, 2) for v in p["effective_rank"]) + "; 99%-energy rank "
                     + ", ".join(_fmt(v, 2) for v in p["rank_99"]) + "; residual at r=4 "
                     + ", ".join(_fmt(v) for v in p["residual_4"]))
    by_arm = {row["arm"]: row for row in rows}
    if REFERENCE in by_arm and HETERO in by_arm:
        a, b = by_arm[HETERO], by_arm[REFERENCE]
        paired = ", ".join(f"{100 * (x - y):+.1f}" for x, y in zip(a["per_seed"], b["per_seed"]))
        lines.append(f"\n{HETERO} − {REFERENCE}: {100 * (a['mean'] - b['mean']):+.1f} points of mean accuracy "
                     f"(per seed: {paired}), {a['bytes_per_round'] / b['bytes_per_round']:.2f}× the bytes per round.")
    tasks = list(rows[0]["tasks"])
    lines += ["", "| arm | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    lines += [f"| {row['arm']} | " + " | ".join(f"{100 * row['tasks'][t]:.1f}" for t in tasks) + " |" for row in rows]
    return "\n".join(lines)


def protocol_note(base, seeds: list[int]) -> str:
    tasks = base.suite or ", ".join(base.tasks)
    return (f"{tasks} on {base.base_model} + LoRA, FedAvg with the exact product (FlexLoRA); {base.num_clients} "
            f"clients (ζ_t = {base.zeta}), participation {base.participation}; {base.rounds} rounds × "
            f"{base.local_steps} steps per held task (batch {base.batch_size}, lr {base.learning_rate}); "
            f"{base.max_train_samples} training / {base.max_test_samples} test samples per task; seeds "
            f"{', '.join(map(str, seeds))}. α = 2·lora_r in every arm (scaling 2). Effective rank, 99%-energy rank "
            "and residuals: the aggregate M of each LoRA module before its truncation to lora_r, means over the "
            "modules (metrics.jsonl's `aggregation`).")


def main(argv=None) -> int:
    parser = recipe_parser(__doc__.splitlines()[0], {})
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=DEFAULT_ARMS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], metavar="SEED")
    parser.add_argument("--llm", action="store_true", help="the LLM recipe's protocol (SmolLM2-135M-Instruct)")
    parser.add_argument("--quick", action="store_true", help="2 tasks, 2 rounds, 1 seed: a smoke run")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    defaults = llm_protocol() if args.llm else MINILM
    if args.quick:
        defaults = {**defaults, **QUICK}
        args.seeds = args.seeds[:1]
    try:
        base = recipe_config(args, defaults, {})
        results = run_seeds(base, {a: ARMS[a] for a in args.arms}, {"": {}}, args.seeds)[""]
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(base.output_dir)
    run_dirs = {a: [out / f"seed{k}" / a for k in args.seeds] for a in args.arms}
    rows = rows_of(results, run_dirs)
    md = markdown(rows, protocol_note(base, args.seeds))
    write_atomic(out / "comparison.md", md + "\n")
    write_atomic(out / "comparison.json", json.dumps(rows, indent=2) + "\n")
    print(md)
    by_arm = {row["arm"]: row for row in rows}
    if REFERENCE in by_arm and HETERO in by_arm:
        print(f"RATIO {HETERO}/{REFERENCE} mean accuracy = {by_arm[HETERO]['mean'] / by_arm[REFERENCE]['mean']:.4f} "
              f"({100 * by_arm[HETERO]['mean']:.1f} / {100 * by_arm[REFERENCE]['mean']:.1f})")
    print(resource_report(time.perf_counter() - start))
    publish_results(args, out, md, argv, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
