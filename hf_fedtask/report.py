"""What a user sees at the end of a run: the per-task results table, the run report with the push
command, the unlearning table, and the per-round PNG plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hf_fedtask.data.backdoor import METRIC as BACKDOOR_METRIC

ADAPTERS_DIR = "adapters"
COMPACT_DIR = "compact"


def results_table(results: dict) -> str:
    """A plain-text per-task table: final metric, metric / individual-centralized reference, chance."""
    rows = [("task", "group", "metric", "value", "normalized", "chance", "n_test")]
    for name, r in results["tasks"].items():
        normalized = f"{r['normalized']:.3f}" if "normalized" in r else "-"
        rows.append((name, r.get("group") or "", r["metric"], f"{r[r['metric']]:.4f}", normalized,
                     f"{r['chance']:.3f}" if r.get("chance") is not None else "-", str(r["num_examples"])))
    mean_normalized = f"{results['mean_normalized']:.3f}" if results.get("mean_normalized") is not None else "-"
    rows.append(("mean", "", "", f"{results['mean_metric']:.4f}", mean_normalized, "", ""))
    if "mean_metric_compact" in results:  # the storage-saving compact export, evaluated on its own
        compact_normalized = results.get("mean_normalized_compact")
        rows.append(("mean (compact export)", "", "", f"{results['mean_metric_compact']:.4f}",
                     f"{compact_normalized:.3f}" if compact_normalized is not None else "-", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def run_report(config, results: dict) -> str:
    """What a finished run prints: the table, communication, where everything is, how to push."""
    out = Path(config.output_dir)
    lines = [results_table(results), ""]
    mb = (results["bytes_uplink"] + results["bytes_downlink"]) / 1e6
    lines.append(f"communication: {results['bytes_uplink']:,} bytes up, {results['bytes_downlink']:,} bytes down "
                 f"({mb:.2f} MB over {results['rounds']} rounds)")
    return "\n".join([*lines, *where_lines(out, results, export=config.export)])


def where_lines(out: Path, results: dict, *, export: bool) -> list[str]:
    """Where a finished run (or an unlearning's result) left its files in `out`, and how to push an adapter:
    the lines `run` and `unlearn` end with."""
    lines = [f"results: {out / 'results.json'}"]
    for plot in ("accuracy_vs_round.png", "unlearning.png"):
        if (out / plot).exists():
            lines.append(f"plot:    {out / plot}")
    if (out / "model.safetensors").exists():  # a client removal's model (`workflows.unlearn.REMOVED_MODEL`)
        lines.append(f"model:   {out / 'model.safetensors'}")
    if export:
        lines.append(f"adapters: {out / ADAPTERS_DIR}/<task>  (stock PeftModel.from_pretrained)")
        storage = results.get("compact_storage")
        if storage:
            lines.append(f"compact: {out / COMPACT_DIR}  ({storage['compact_bytes']:,} bytes vs "
                         f"{storage['separate_bytes']:,} for {storage['tasks']} separate adapters, "
                         f"ratio {storage['ratio']:.3f}; hf_fedtask.load_task_adapter(dir, task))")
        first = next(iter(results["tasks"]))
        lines.append(f"push:    hf-fedtask push {out / ADAPTERS_DIR / first} "
                     f"--repo-id <you>/{results['strategy']}-{first}")
    return lines


def evaluated(history: list[dict]) -> list[dict]:
    """The round records that carry an evaluation (`eval_every` > 1 leaves the others without)."""
    return [h for h in history if "eval" in h]


def forgetting(record: dict) -> bool:
    """Whether the round negated forgotten tasks' or clients' updates."""
    return any(k in record for k in ("forgotten_tasks", "forgotten", "forgotten_clients"))


def headline_metric(record: dict, task: str) -> float:
    """A round record's headline metric for `task` (the first one its evaluation reports)."""
    return next(v for k, v in record["eval"][task].items() if k != "num_examples")


def forgotten_what(unlearning: dict, quote: str = "") -> str:
    """"task(s) a, b" and/or "client(s) 3": what an unlearning result removed (task names in `quote`)."""
    parts = []
    if unlearning.get("tasks"):
        parts.append("task(s) " + ", ".join(f"{quote}{t}{quote}" for t in unlearning["tasks"]))
    if unlearning.get("forgotten_clients"):
        parts.append(f"client(s) {', '.join(map(str, unlearning['forgotten_clients']))}")
    return " and ".join(parts)


def unlearning_report(results: dict) -> str:
    """Console table of an unlearning result: each task's metric before and after, forgotten first."""
    u = results["unlearning"]
    lines = [f"unlearned {forgotten_what(u)}: {u['method']}", f"{'task':<22}{'before':>9}{'after':>9}"]
    order = [*u["tasks"], *(t for t in results["tasks"] if t not in u["tasks"])]
    for task in order:
        metric = results["tasks"][task]["metric"]
        before = f"{u['before'][task][metric]:.4f}" if u.get("before") else "–"
        chance = results["tasks"][task]["chance"]
        mark = ("" if task not in u["tasks"] else " (forgotten)" if chance is None
                else f" (forgotten; chance {chance:.3f})")
        lines.append(f"{task:<22}{before:>9}{u['after'][task][metric]:>9.4f}{mark}")
        if BACKDOOR_METRIC in u["after"][task]:
            was = f"{u['before'][task][BACKDOOR_METRIC]:.4f}" if u.get("before") else "–"
            lines.append(f"{'  backdoor success':<22}{was:>9}{u['after'][task][BACKDOOR_METRIC]:>9.4f}")
    if "seconds" in u:
        per_round = f" (one training round: {u['round_seconds']:.2f} s)" if u.get("round_seconds") else ""
        lines.append(f"removal took {u['seconds']:.2f} s{per_round} and {u['client_messages']} client message(s)")
    if "how" in u:
        lines.append(u["how"])
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_round_plot(fig, ax, path: Path, title: str) -> Path:
    """Label a per-round metric plot (integer round ticks, legend right of the axes), save it as PNG."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("test metric")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def plot_metric_vs_round(history: list[dict], path: Path, title: str = "") -> Path:
    """PNG of each task's metric and the mean over rounds."""
    plt = pyplot()
    history = evaluated(history)
    rounds = [h["round"] for h in history]
    tasks = list(history[0]["eval"])
    labelled = len(tasks) <= 10  # beyond that a legend is unreadable: draw tasks in grey
    fig, ax = plt.subplots(figsize=(9 if labelled else 7, 4.5))
    for i, task in enumerate(tasks):
        values = [headline_metric(h, task) for h in history]
        style = ({"color": f"C{i + 1}", "label": task, "linewidth": 1.2} if labelled
                 else {"color": "0.75", "linewidth": 0.8})
        ax.plot(rounds, values, marker="." if labelled else None, **style)
    ax.plot(rounds, [h["mean_metric"] for h in history], color="C0", linewidth=3, label="mean over tasks")
    return _save_round_plot(fig, ax, path, title)


def plot_unlearning(history: list[dict], path: Path, chance: dict[str, float], title: str = "") -> Path:
    """PNG of the forgotten tasks' metric (with their chance level) and every retained task's, per
    round, with the round unlearning started marked."""
    plt = pyplot()
    start = next(h["round"] for h in history if forgetting(h))
    history = evaluated(history)
    rounds = [h["round"] for h in history]
    forgotten = list(next((h["forgotten"] for h in history if "forgotten" in h), {}))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for task in history[0]["eval"]:
        values = [headline_metric(h, task) for h in history]
        if task in forgotten:
            line = ax.plot(rounds, values, marker="o", linewidth=2.5, label=f"forgotten: {task}")[0]
            if chance.get(task) is not None:  # a free-text task has no chance level
                ax.axhline(chance[task], color=line.get_color(), linestyle=":", linewidth=1, label=f"chance ({task})")
        else:
            ax.plot(rounds, values, color="0.75", linewidth=0.8)
    retained = [float(np.mean([headline_metric(h, t) for t in h["eval"] if t not in forgotten])) for h in history]
    ax.plot(rounds, retained, color="C2", linewidth=2.5, marker=".", label="retained tasks (mean; grey: each)")
    ax.axvline(start - 0.5, color="k", linestyle="--", linewidth=1, label="unlearning starts")
    return _save_round_plot(fig, ax, path, title)


def mean_curve(history: list[dict]) -> dict[int, float]:
    """Round -> mean metric in %, over the evaluated rounds."""
    return {h["round"]: 100 * h["mean_metric"] for h in evaluated(history)}


def plot_curves_by_setting(curves: dict[str, dict[str, dict[int, float]]], titles: dict[str, str], path: Path,
                           ylabel: str = "test accuracy (%)") -> Path:
    """One panel per setting, one line per method over rounds (`curves[setting][method]`: round ->
    value, `mean_curve`): the per-round figure of the method-comparison recipes."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(4.5 * len(curves), 3.4), squeeze=False)
    for ax, (setting, by_method) in zip(axes[0], curves.items()):
        for method, values in by_method.items():
            ax.plot([int(r) for r in values], list(values.values()), label=method)
        ax.set_title(titles[setting], fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
