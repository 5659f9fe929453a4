"""Method-comparison tables (the MaTU paper's Tables 1-2 on our suites): run several strategies
under several settings from one base config, then tabulate per-task and mean accuracy, normalized
accuracy and communication, with the shipped individual-centralized reference as a row.

Each (setting, strategy) run lives in `<output_dir>/<setting>/<strategy>/`; rerunning the same
comparison resumes finished and unfinished runs instead of starting over.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from hf_fedtask.config import RunConfig
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE
from hf_fedtask.core.files import write_atomic
from hf_fedtask.data.reference import shipped_reference
from hf_fedtask.engine.run import run
from hf_fedtask.engine.run_folder import METRICS_FILE, RESULTS_FILE
from hf_fedtask.privacy.report import round_clients
from hf_fedtask.report import pyplot

INDIVIDUAL = "individual"


def run_comparison(base: RunConfig, methods: list[str] | dict[str, dict], settings: dict[str, dict]) -> dict:
    """{setting: {method: results}} for every pair. `methods`: strategy names, or method names mapped
    to RunConfig overrides (e.g. {"full_fedavg": {"strategy": "fedavg", "peft_method": "full"}});
    `settings` maps a name to RunConfig overrides."""
    if not isinstance(methods, dict):
        methods = {name: {"strategy": name} for name in methods}
    table: dict[str, dict] = {}
    for setting, overrides in settings.items():
        table[setting] = {}
        for method, method_overrides in methods.items():
            method_overrides = dict(method_overrides)
            config = base.for_strategy(method_overrides.pop("strategy", method), **method_overrides, **overrides,
                                       output_dir=str(Path(base.output_dir) / setting / method))
            table[setting][method] = finished_results(config) or run(
                config, resume=(Path(config.output_dir) / CHECKPOINT_FILE).exists())
    return table


def finished_results(config: RunConfig) -> dict | None:
    """The results.json already in `config.output_dir` if it is this run, finished."""
    path = Path(config.output_dir) / RESULTS_FILE
    if not path.exists():
        return None
    results = json.loads(path.read_text())
    previous = RunConfig.from_dict(results["config"], source=str(path), saved=True)
    return results if previous.same_run(config) and results["rounds"] == config.rounds else None


def run_seeds(base: RunConfig, methods: list[str] | dict[str, dict], settings: dict[str, dict],
              seeds: list[int]) -> dict:
    """`run_comparison` once per seed (runs under `<output_dir>/seed<k>/`): {setting: {method: [results
    per seed]}}, what `write_comparison` tabulates as mean ± std."""
    per_seed = [run_comparison(dataclasses.replace(base, seed=k, output_dir=str(Path(base.output_dir) / f"seed{k}")),
                               methods, settings) for k in seeds]
    return {setting: {method: [table[setting][method] for table in per_seed] for method in per_seed[0][setting]}
            for setting in per_seed[0]}


def paper_fedavg_bytes_per_round(results: dict, run_dir: Path) -> float | None:
    """Both directions' bytes per round had each client sent one adapter per task it holds (the MaTU
    paper's FedAvg protocol), from a FedAvg-style run's own traffic: a client holding n tasks sends and
    receives its shared modules n times instead of once (float32, like ours). None without the run's
    metrics log or allocation."""
    metrics, allocation = Path(run_dir) / METRICS_FILE, results.get("allocation")
    if not metrics.exists() or allocation is None:
        return None
    history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    shared_bytes = 4 * results["shared_parameters"]
    extra = [sum(2 * shared_bytes * (len(allocation[str(c)]) - 1) for c in round_clients(h)) for h in history]
    ours = [h["bytes_uplink"] + h["bytes_downlink"] for h in history]
    return float(np.mean(ours) + np.mean(extra)) if history else None


PAPER_PROTOCOL = ("fedavg", "fedprox")
"""Rows whose wire protocol the paper's FedAvg one-adapter-per-task count applies to."""


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean over seeds, and the standard deviation when there is more than one."""
    return float(np.mean(values)), float(np.std(values)) if len(values) > 1 else None


def summary_rows(results_by_strategy: dict[str, dict | list[dict]], base_model: str) -> list[dict]:
    """One row per method (plus the individual-centralized reference when one ships); a method's
    results may be a list over seeds, whose mean and standard deviation the row holds."""
    rows = []
    by_method = {m: r if isinstance(r, list) else [r] for m, r in results_by_strategy.items()}
    tasks = list(next(iter(by_method.values()))[0]["tasks"])
    reference = shipped_reference(base_model)
    if all(t in reference for t in tasks):
        accs = {t: reference[t]["accuracy"] for t in tasks}
        rows.append({"method": INDIVIDUAL, "tasks": accs, "mean": sum(accs.values()) / len(accs), "normalized": 1.0,
                     "bytes_per_round": 0, "seeds": 0})
    for name, runs in by_method.items():
        means = [r["mean_metric"] for r in runs]
        norms = [r["mean_normalized"] for r in runs]
        row = {
            "method": name,
            "seeds": len(runs),
            "tasks": {t: _mean_std([r["tasks"][t][r["tasks"][t]["metric"]] for r in runs])[0] for t in tasks},
            "mean": _mean_std(means)[0], "mean_std": _mean_std(means)[1],
            "normalized": _mean_std(norms)[0] if None not in norms else None,
            "normalized_std": _mean_std(norms)[1] if None not in norms else None,
            "bytes_per_round": float(np.mean([(r["bytes_uplink"] + r["bytes_downlink"]) / max(r["rounds"], 1)
                                              for r in runs])),
        }
        if all("mean_metric_compact" in r for r in runs):
            row["mean_compact"], row["mean_compact_std"] = _mean_std([r["mean_metric_compact"] for r in runs])
        if runs[0]["strategy"] in PAPER_PROTOCOL:
            paper = [paper_fedavg_bytes_per_round(r, Path(r["config"]["output_dir"])) for r in runs]
            row["paper_bytes_per_round"] = float(np.mean(paper)) if None not in paper else None
        rows.append(row)
    return rows


def _pm(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "-"
    return f"{100 * mean:.1f}" + (f" ± {100 * std:.1f}" if std is not None else "")


def markdown_table(rows: list[dict], title: str) -> str:
    """Per-task accuracy % (seed means), mean and normalized (± std over seeds), MB per round (both
    directions, measured), and for FedAvg-style rows the paper protocol's MB per round."""
    tasks = list(rows[0]["tasks"])
    paper = any("paper_bytes_per_round" in r for r in rows)
    head = ("| method | " + " | ".join(tasks) + " | mean | normalized | MB/round |"
            + (" MB/round, one adapter per task |" if paper else ""))
    lines = [f"**{title}**", "", head, "|" + "---|" * (len(tasks) + 4 + paper)]
    for row in rows:
        cells = [f"{100 * row['tasks'][t]:.1f}" for t in tasks]
        mb = f"{row['bytes_per_round'] / 1e6:.2f}" if row["bytes_per_round"] else "-"
        line = (f"| {row['method']} | " + " | ".join(cells) + f" | **{_pm(row['mean'], row.get('mean_std'))}** | "
                f"{_pm(row['normalized'], row.get('normalized_std'))} | {mb} |")
        if paper:
            extra = row.get("paper_bytes_per_round")
            line += f" {extra / 1e6:.2f} |" if extra else " - |"
        lines.append(line)
        if "mean_compact" in row:
            lines.append(f"| {row['method']} (compact export) | " + " | ".join("" for _ in tasks)
                         + f" | {_pm(row['mean_compact'], row.get('mean_compact_std'))} | | |"
                         + (" |" if paper else ""))
    return "\n".join(lines)


def write_comparison(table: dict, base: RunConfig, titles: dict[str, str], notes: str = "") -> Path:
    """`<output_dir>/comparison.md` (`notes` first) and `comparison.json`; returns the markdown path.
    `table`: {setting: {method: results, or a list of results over seeds}}."""
    out = Path(base.output_dir)
    rows = {setting: summary_rows(by_strategy, base.base_model) for setting, by_strategy in table.items()}
    md = "\n\n".join([notes.strip()] * bool(notes) + [markdown_table(rows[s], titles.get(s, s)) for s in rows])
    write_atomic(out / "comparison.md", md + "\n")
    write_atomic(out / "comparison.json", json.dumps(rows, indent=2) + "\n")
    plot_comparison(rows, out / "comparison.png")
    return out / "comparison.md"


def plot_comparison(rows: dict[str, list[dict]], path: Path) -> Path:
    """Grouped bars: mean accuracy per method (± std over seeds), one group per setting."""
    plt = pyplot()

    settings = list(rows)
    methods = [r["method"] for r in rows[settings[0]]]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(methods), 4))
    width = 0.8 / len(settings)
    for i, setting in enumerate(settings):
        means = {r["method"]: 100 * r["mean"] for r in rows[setting]}
        stds = {r["method"]: 100 * (r.get("mean_std") or 0) for r in rows[setting]}
        xs = [m + i * width for m in range(len(methods))]
        ax.bar(xs, [means.get(m, 0) for m in methods], width, yerr=[stds.get(m, 0) for m in methods], capsize=3,
               label=setting)
    ax.set_xticks([m + width * (len(settings) - 1) / 2 for m in range(len(methods))], methods)
    ax.set_ylabel("mean test accuracy (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


