"""What a finished run leaves behind besides its checkpoint: one PEFT adapter folder per task
(with a model card), a results table on the console, and a plot of the metric per round."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hf_fedtask.export.compact import save_compact
from hf_fedtask.export.adapter import save_adapter
from hf_fedtask.export.hub import render_model_card
from hf_fedtask.export.linearized import save_linearized
from hf_fedtask.export.multi_adapter import PAD_BIAS, save_multi_adapter

if TYPE_CHECKING:
    from hf_fedtask.engine.run import Simulation
    from hf_fedtask.strategies import GlobalState

ADAPTERS_DIR = "adapters"
COMPACT_DIR = "compact"
LINEARIZED_DIR = "linearized"
MULTI_ADAPTER_DIR = "multi_adapter"


def export_adapters(sim: Simulation, state: GlobalState, results: dict, run_dir: Path) -> Path | None:
    """`run_dir/adapters/<task>/`: a stock PEFT adapter (shared modules + the task's head) per task.
    Strategies with a compact form (MaTU) also get `run_dir/compact/` (one unified vector, T
    bit-packed masks and rescalers; `hf_fedtask.load_task_adapter`), whose path is returned."""
    peft_config = sim.host.model.peft_config["default"]
    cards = {}
    # a stock adapter is the ordinary model at θ: for linearized runs its metric is `<metric>_nonlinear`
    metrics = {name: {r["metric"]: r.get(f"{r['metric']}_nonlinear", r[r["metric"]])}
               for name, r in results["tasks"].items()}
    for task in sim.tasks:
        info = {
            "base_model": sim.base.model_id,
            "task": task.name,
            "label_names": task.label_names,
            "num_labels": task.num_labels,
            "strategy": sim.strategy.name,
            "strategy_paper": sim.strategy.paper,
            "peft_method": sim.config.peft_method,
            "metrics": {task.name: metrics[task.name]},
            "hyperparameters": {**sim.strategy.hyperparameters(), **_training_hparams(sim)},
            "rounds": results["rounds"],
            "num_clients": results["num_clients"],
            "participation": sim.config.participation,
            "bytes_communicated": results["bytes_uplink"] + results["bytes_downlink"],
            "modality": task.modality,
            "extra_notes": " ".join(filter(None, [
                (f"Inputs are tokenized with truncation to {sim.config.max_length} tokens." if task.modality == "text"
                 else "Images are converted to RGB, then prepared by the base model's image processor."),
                unlearning_note(results), linearization_note(results, task.name)])),
        }
        cards[task.name] = render_model_card(info)
        params = sim.strategy.task_parameters(state, task.name, sim.client_stores)
        save_adapter(run_dir / ADAPTERS_DIR / task.name, peft_config=peft_config, state_dict=params,
                     base_model_id=sim.base.model_id, card=cards[task.name])
        point = sim.strategy.linearization_point(state, task.name)
        if point is not None:
            save_linearized(run_dir / LINEARIZED_DIR / task.name, peft_config=peft_config, point=point,
                            delta=params - point, base_model_id=sim.base.model_id, num_labels=task.num_labels,
                            mode=sim.strategy.linearization,
                            info={"task": task.name, "metrics": {k: v for k, v in results["tasks"][task.name].items()
                                                                 if k.startswith(task.metric)}})
    if sim.strategy.per_task_modules:
        save_multi_adapter(run_dir / MULTI_ADAPTER_DIR, peft_config=peft_config, head_keys=sim.host.head_keys,
                           task_states={t.name: sim.strategy.task_parameters(state, t.name) for t in sim.tasks},
                           label_names={t.name: t.label_names for t in sim.tasks}, base_model_id=sim.base.model_id,
                           card=str(_multi_adapter_card(sim, results, metrics)))
    compact_form = getattr(sim.strategy, "compact_form", None)
    if compact_form is None:
        return None
    return save_compact(
        run_dir / COMPACT_DIR,
        peft_config=peft_config,
        base_model_id=sim.base.model_id,
        **compact_form(state),
        label_names={t.name: t.label_names for t in sim.tasks},
        card=_compact_card(sim, results),
        overwrite=True,
    )


def unlearning_note(results: dict) -> str | None:
    """The card's account of a removed task: which, how, from which round, and its metric before/after."""
    u = results.get("unlearning")
    if not u:
        return None
    metric = {t: results["tasks"][t]["metric"] for t in u["tasks"]}
    change = "; ".join(
        f"`{t}` {metric[t]} {u['before'][t][metric[t]]:.4f} → {u['after'][t][metric[t]]:.4f}" if u.get("before")
        else f"`{t}` {metric[t]} {u['after'][t][metric[t]]:.4f}" for t in u["tasks"])
    if "from_round" in u:
        how = (f"in rounds {u['from_round']}–{u['from_round'] + u['rounds'] - 1} the updates of the "
               f"{len(u['clients'])} client(s) holding it were negated before aggregation (NTKFedAvg Alg. 1, lines 8–9)")
    else:
        how = f"its accumulated task vector, scaled by {u['scale']}, was subtracted from the merged model (task arithmetic)"
    return f"**Unlearned task(s) {', '.join(f'`{t}`' for t in u['tasks'])}**: {how}. Before → after: {change}."


def linearization_note(results: dict, task: str) -> str | None:
    """For linearized strategies: which metric belongs to which artifact."""
    r = results["tasks"][task]
    metric = r["metric"]
    if f"{metric}_nonlinear" not in r:
        return None
    return (f"**Linearized training.** The clients trained the linearization f(θ_lin) + J(θ_lin)·(θ − θ_lin). "
            f"This folder holds the final θ as an ordinary (non-linear) adapter: {metric} {r[f'{metric}_nonlinear']:.4f}. "
            f"The linearized model itself ({metric} {r[metric]:.4f}) is exported as `linearized/{task}/` of the run "
            "(θ_lin adapter + delta; load it with `hf_fedtask.load_linearized`).")


def _multi_adapter_card(sim: Simulation, results: dict, metrics: dict) -> str:
    first = sim.tasks[0].name
    width = max(t.num_labels for t in sim.tasks)
    snippet = (f"```python\nmodel = PeftModel.from_pretrained(base, \"<this folder>\", adapter_name=\"{first}\")  "
               f"# base with num_labels={width}\nmodel.load_adapter(\"<this folder>/<task>\", adapter_name=\"<task>\")\n"
               "model.set_adapter(\"<task>\")\n```")
    info = {
        "base_model": sim.base.model_id,
        "task": [t.name for t in sim.tasks],
        "num_labels": width,
        "strategy": sim.strategy.name,
        "strategy_paper": sim.strategy.paper,
        "peft_method": sim.config.peft_method,
        "metrics": metrics,
        "hyperparameters": {**sim.strategy.hyperparameters(), **_training_hparams(sim)},
        "rounds": results["rounds"],
        "num_clients": results["num_clients"],
        "participation": sim.config.participation,
        "bytes_communicated": results["bytes_uplink"] + results["bytes_downlink"],
        "modality": sim.tasks[0].modality,
        "extra_notes": (f"**One adapter per task** (PEFT multi-adapter layout): `{first}` at the root, every other "
                        f"task in its subfolder, `tasks.json` lists them with their label names. Sharing variant: "
                        f"`{getattr(sim.strategy, 'share', 'none')}`. Load and switch:\n\n{snippet}\n\n"
                        f"Heads are padded to {width} classes (padding rows: zero weights, bias {PAD_BIAS:g}); a "
                        "task's own classes are its first `num_labels` logits."),
    }
    return render_model_card(info)


def _compact_card(sim: Simulation, results: dict) -> str:
    rows = "\n".join(f"| {name} | {r[r['metric']]:.4f} |" for name, r in results["tasks"].items())
    return (f"# {sim.strategy.name} compact export of {len(sim.tasks)} tasks\n\n"
            f"Base model `{sim.base.model_id}`. Task t's adapter is θ_p + λ_t·(m_t ⊙ τ) plus its head:\n\n"
            "```python\nfrom hf_fedtask import load_task_adapter\nmodel = load_task_adapter(\"<this folder>\", \"<task>\")\n```\n\n"
            f"Total communication during training: {results['bytes_uplink'] + results['bytes_downlink']} bytes.\n\n"
            f"| task | metric |\n|---|---|\n{rows}\n")


def _training_hparams(sim: Simulation) -> dict:
    c = sim.config
    keys = ("peft_method", "lora_r", "lora_alpha", "local_epochs", "local_steps", "batch_size", "learning_rate",
            "lr_scheduler", "zeta", "partition", "seed")
    return {k: getattr(c, k) for k in keys}


def results_table(results: dict) -> str:
    """A plain-text per-task table: final metric, metric / individual-centralized reference, chance."""
    rows = [("task", "group", "metric", "value", "normalized", "chance", "n_test")]
    for name, r in results["tasks"].items():
        normalized = f"{r['normalized']:.3f}" if "normalized" in r else "-"
        rows.append((name, r.get("group") or "", r["metric"], f"{r[r['metric']]:.4f}", normalized,
                     f"{r['chance']:.3f}", str(r["num_examples"])))
    mean_normalized = f"{results['mean_normalized']:.3f}" if results.get("mean_normalized") is not None else "-"
    rows.append(("mean", "", "", f"{results['mean_metric']:.4f}", mean_normalized, "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def run_report(config, results: dict) -> str:
    """What a finished run prints: the table, communication, where everything is, how to push."""
    out = Path(config.output_dir)
    lines = [results_table(results), ""]
    mb = (results["bytes_uplink"] + results["bytes_downlink"]) / 1e6
    lines.append(f"communication: {results['bytes_uplink']:,} bytes up, {results['bytes_downlink']:,} bytes down "
                 f"({mb:.2f} MB over {results['rounds']} rounds)")
    lines.append(f"results: {out / 'results.json'}")
    if (out / "accuracy_vs_round.png").exists():
        lines.append(f"plot:    {out / 'accuracy_vs_round.png'}")
    if config.export:
        lines.append(f"adapters: {out / ADAPTERS_DIR}/<task>  (stock PeftModel.from_pretrained)")
        storage = results.get("compact_storage")
        if storage:
            lines.append(f"compact: {out / COMPACT_DIR}  ({storage['compact_bytes']:,} bytes vs "
                         f"{storage['separate_bytes']:,} for {storage['tasks']} separate adapters, "
                         f"ratio {storage['ratio']:.3f}; hf_fedtask.load_task_adapter(dir, task))")
        first = next(iter(results["tasks"]))
        lines.append(f"push:    hf-fedtask push {out / ADAPTERS_DIR / first} --repo-id <you>/{results['strategy']}-{first}")
    return "\n".join(lines)


def headline_metric(record: dict, task: str) -> float:
    """A round record's headline metric for `task` (the first one its evaluation reports)."""
    return next(v for k, v in record["eval"][task].items() if k != "num_examples")


def unlearning_report(results: dict) -> str:
    """Console table of an unlearning result: each task's metric before and after, forgotten first."""
    u = results["unlearning"]
    lines = [f"unlearned {', '.join(u['tasks'])}: {u['method']}", f"{'task':<22}{'before':>9}{'after':>9}"]
    order = [*u["tasks"], *(t for t in results["tasks"] if t not in u["tasks"])]
    for task in order:
        metric = results["tasks"][task]["metric"]
        before = f"{u['before'][task][metric]:.4f}" if u.get("before") else "–"
        mark = " (forgotten; chance {:.3f})".format(results["tasks"][task]["chance"]) if task in u["tasks"] else ""
        lines.append(f"{task:<22}{before:>9}{u['after'][task][metric]:>9.4f}{mark}")
    return "\n".join(lines)


def _pyplot():
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
    _pyplot().close(fig)
    return path


def plot_metric_vs_round(history: list[dict], path: Path, title: str = "") -> Path:
    """PNG of each task's metric and the mean over rounds."""
    plt = _pyplot()
    rounds = [h["round"] for h in history]
    tasks = list(history[0]["eval"])
    labelled = len(tasks) <= 10  # beyond that a legend is unreadable: draw tasks in grey
    fig, ax = plt.subplots(figsize=(9 if labelled else 7, 4.5))
    for i, task in enumerate(tasks):
        values = [headline_metric(h, task) for h in history]
        style = {"color": f"C{i + 1}", "label": task, "linewidth": 1.2} if labelled else {"color": "0.75", "linewidth": 0.8}
        ax.plot(rounds, values, marker="." if labelled else None, **style)
    ax.plot(rounds, [h["mean_metric"] for h in history], color="C0", linewidth=3, label="mean over tasks")
    return _save_round_plot(fig, ax, path, title)


def plot_unlearning(history: list[dict], path: Path, chance: dict[str, float], title: str = "") -> Path:
    """PNG of the forgotten tasks' metric (with their chance level) and every retained task's, per
    round, with the round unlearning started marked."""
    plt = _pyplot()
    rounds = [h["round"] for h in history]
    start = next(h["round"] for h in history if "forgotten" in h)
    forgotten = list(next(h for h in history if "forgotten" in h)["forgotten"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for task in history[0]["eval"]:
        values = [headline_metric(h, task) for h in history]
        if task in forgotten:
            line = ax.plot(rounds, values, marker="o", linewidth=2.5, label=f"forgotten: {task}")[0]
            ax.axhline(chance[task], color=line.get_color(), linestyle=":", linewidth=1, label=f"chance ({task})")
        else:
            ax.plot(rounds, values, color="0.75", linewidth=0.8)
    retained = [float(np.mean([headline_metric(h, t) for t in h["eval"] if t not in forgotten])) for h in history]
    ax.plot(rounds, retained, color="C2", linewidth=2.5, marker=".", label="retained tasks (mean; grey: each)")
    ax.axvline(start - 0.5, color="k", linestyle="--", linewidth=1, label="unlearning starts")
    return _save_round_plot(fig, ax, path, title)
