"""Method-comparison tables (the MaTU paper's Tables 1-2 on our suites): run several strategies
under several settings from one base config, then tabulate per-task and mean accuracy, normalized
accuracy and communication, with the shipped individual-centralized reference as a row.

Each (setting, strategy) run lives in `<output_dir>/<setting>/<strategy>/`; rerunning the same
comparison resumes finished and unfinished runs instead of starting over.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_fedtask.config import RunConfig
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE
from hf_fedtask.core.files import write_atomic
from hf_fedtask.data.reference import shipped_reference
from hf_fedtask.engine.run import RESULTS_FILE, run
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


def summary_rows(results_by_strategy: dict[str, dict], base_model: str) -> list[dict]:
    """One row per strategy (plus the individual-centralized reference when one ships)."""
    rows = []
    tasks = list(next(iter(results_by_strategy.values()))["tasks"])
    reference = shipped_reference(base_model)
    if all(t in reference for t in tasks):
        accs = {t: reference[t]["accuracy"] for t in tasks}
        rows.append({"method": INDIVIDUAL, "tasks": accs, "mean": sum(accs.values()) / len(accs), "normalized": 1.0,
                     "bytes_per_round": 0})
    for name, r in results_by_strategy.items():
        rows.append({
            "method": name,
            "tasks": {t: v[v["metric"]] for t, v in r["tasks"].items()},
            "mean": r["mean_metric"],
            "normalized": r["mean_normalized"],
            "bytes_per_round": (r["bytes_uplink"] + r["bytes_downlink"]) / max(r["rounds"], 1),
        })
    return rows


def markdown_table(rows: list[dict], title: str) -> str:
    tasks = list(rows[0]["tasks"])
    head = "| method | " + " | ".join(tasks) + " | mean | normalized | MB/round |"
    lines = [f"**{title}**", "", head, "|" + "---|" * (len(tasks) + 4)]
    for row in rows:
        cells = [f"{100 * row['tasks'][t]:.1f}" for t in tasks]
        norm = f"{100 * row['normalized']:.1f}" if row["normalized"] is not None else "-"
        mb = f"{row['bytes_per_round'] / 1e6:.2f}" if row["bytes_per_round"] else "-"
        lines.append(f"| {row['method']} | " + " | ".join(cells) + f" | **{100 * row['mean']:.1f}** | {norm} | {mb} |")
    return "\n".join(lines)


def write_comparison(table: dict, base: RunConfig, titles: dict[str, str]) -> Path:
    """`<output_dir>/comparison.md` and `comparison.json`; returns the markdown path."""
    out = Path(base.output_dir)
    rows = {setting: summary_rows(by_strategy, base.base_model) for setting, by_strategy in table.items()}
    md = "\n\n".join(markdown_table(rows[s], titles.get(s, s)) for s in rows)
    write_atomic(out / "comparison.md", md + "\n")
    write_atomic(out / "comparison.json", json.dumps(rows, indent=2) + "\n")
    plot_comparison(rows, out / "comparison.png")
    return out / "comparison.md"


def plot_comparison(rows: dict[str, list[dict]], path: Path) -> Path:
    """Grouped bars: mean accuracy per method, one group per setting."""
    plt = pyplot()

    settings = list(rows)
    methods = [r["method"] for r in rows[settings[0]]]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(methods), 4))
    width = 0.8 / len(settings)
    for i, setting in enumerate(settings):
        means = {r["method"]: 100 * r["mean"] for r in rows[setting]}
        xs = [m + i * width for m in range(len(methods))]
        ax.bar(xs, [means.get(m, 0) for m in methods], width, label=setting)
    ax.set_xticks([m + width * (len(settings) - 1) / 2 for m in range(len(methods))], methods)
    ax.set_ylabel("mean test accuracy (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


