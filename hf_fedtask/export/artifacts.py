"""What a finished run leaves behind besides its checkpoint: one PEFT adapter folder per task
(with a model card), a results table on the console, and a plot of the metric per round."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hf_fedtask.core.files import remove_stale_staging
from hf_fedtask.core.progress import progress_bar
from hf_fedtask.data.backdoor import METRIC as BACKDOOR_METRIC
from hf_fedtask.export.adapter import classifier_config_for, save_adapter
from hf_fedtask.export.compact import save_compact
from hf_fedtask.export.hub import render_model_card
from hf_fedtask.export.linearized import save_linearized
from hf_fedtask.export.multi_adapter import save_multi_adapter
from hf_fedtask.export.tct import save_tct

if TYPE_CHECKING:
    from peft import PeftConfig

    from hf_fedtask.config import RunConfig
    from hf_fedtask.core.state import ClientStore, GlobalState
    from hf_fedtask.core.taskvector import TaskVector
    from hf_fedtask.data.task import Task
    from hf_fedtask.model.output_space import OutputSpace
    from hf_fedtask.strategies import Strategy

from hf_fedtask.report import ADAPTERS_DIR, COMPACT_DIR, forgotten_what

LINEARIZED_DIR = "linearized"
TCT_DIR = "tct"
MULTI_ADAPTER_DIR = "multi_adapter"


@dataclass
class RunExport:
    """What exporting a run needs, and nothing else: no data, no engine."""

    config: RunConfig
    strategy: Strategy
    tasks: list[Task]  # name, label names, modality
    peft_config: PeftConfig
    head_keys: list[str]
    base_model_id: str
    stores: dict[int, ClientStore] | None = None  # clients' stores, when the engine held them
    classifier_config: object | None = None  # the classifier's transformers config (labels set per task)
    processor: object | None = None  # tokenizer or image processor, saved beside each adapter
    output_space: OutputSpace | None = None  # a shared head is cut to each task's rows (None: per-task heads)
    causal_lm: bool = False  # the base is a causal LM answering instructions: cards show the prompt, no classifier/

    def card_modality(self, task: Task) -> str:
        """What a task's card describes: "causal_lm", or the classifier's input modality."""
        return "causal_lm" if self.causal_lm else task.modality

    def prompt_info(self, task: Task) -> dict:
        """A causal LM's card entries for `task`: its prompt template and answer words (empty otherwise)."""
        if not self.causal_lm:
            return {}
        from hf_fedtask.model.instructions import label_words, prompt_template, user_message

        words = label_words(task.label_names)
        return {"prompt_template": prompt_template(self.processor, task.instruction, words), "label_words": words,
                "user_message": user_message(task.instruction, words, "{input}")}

    def task_view(self, params: TaskVector, task: str) -> TaskVector:
        """`params` as `task`'s own classifier (`OutputSpace.task_view`)."""
        return params if self.output_space is None else self.output_space.task_view(params, task, self.head_keys)

    def task_source(self, task: str) -> str:
        """What `load_task` loads `task` by: the run's `tasks` entry for it (a local path made absolute, so
        it resolves from anywhere), else its name (a builtin suite's task)."""
        refs = list(self.config.tasks or ())
        names = [t.name for t in self.tasks]
        if len(refs) != len(names) or task not in names:
            return task
        ref = str(refs[names.index(task)])
        return str(Path(ref).resolve()) if Path(ref).exists() else ref

    def labelled_config(self, task: Task):
        """The classifier's transformers config naming `task`'s labels (None for a causal LM)."""
        if self.classifier_config is None or self.causal_lm:
            return None
        return classifier_config_for(self.classifier_config, task.label_names, self.base_model_id)

    def metadata(self, task: Task, results: dict, metric: dict) -> dict:
        """The adapter folder's `hf_fedtask.json` (`hf_fedtask.export.adapter.METADATA_FILE`): what `task`'s
        adapter was trained and scored on (`metric`: {name: value} of this adapter)."""
        c = self.config
        return {
            "task": task.name, "task_source": self.task_source(task.name), "label_names": list(task.label_names),
            "modality": self.card_modality(task), "base_model": self.base_model_id,
            "base_model_revision": results.get("base_model_revision"), "max_length": c.max_length,
            "data": {"seed": c.seed, "builtin_train_size": c.builtin_train_size},
            "evaluation": {"split": "test", "max_test_samples": c.max_test_samples,
                           "num_examples": results["tasks"][task.name].get("num_examples"), **metric},
        }


def export_adapters(spec: RunExport, state: GlobalState, results: dict, run_dir: Path) -> Path | None:
    # call under the run folder's lock (`hf_fedtask.core.files.folder_lock`): it clears stale staging folders
    """`run_dir/adapters/<task>/`: a stock PEFT adapter (shared modules + the task's head) per task.
    Strategies with a compact form (MaTU) also get `run_dir/compact/` (one unified vector, T
    bit-packed masks and rescalers; `hf_fedtask.load_task_adapter`), whose path is returned. A delayed
    progress bar on stderr counts the tasks and the packages after them (`hf_fedtask.core.progress`)."""
    # the declared exports, each through the hook it comes with: linearized (`Linearized`), tct (`Packaging`),
    # compact (`CompactExport`); the strategy contract test keeps declarations and hooks together
    exports = spec.strategy.capabilities.exports
    steps = len(spec.tasks) + sum(kind in exports for kind in ("tct", "multi_adapter", "compact"))
    with progress_bar(desc="export", total=steps, unit="step", leave=False) as bar:
        return _export(spec, state, results, run_dir, exports, bar)


def _export(spec: RunExport, state: GlobalState, results: dict, run_dir: Path, exports, bar) -> Path | None:
    """`export_adapters`' work, `bar` advanced after each task and each package."""
    peft_config = spec.peft_config
    for folder in (run_dir, run_dir / ADAPTERS_DIR, run_dir / LINEARIZED_DIR, run_dir / TCT_DIR):  # a killed export's
        remove_stale_staging(folder)
    cards = {}
    # a stock adapter is the ordinary model at θ: for linearized runs its metric is `<metric>_nonlinear`
    metrics = {name: {r["metric"]: r.get(f"{r['metric']}_nonlinear", r[r["metric"]])}
               for name, r in results["tasks"].items()}
    for task in spec.tasks:
        bar.set_postfix_str(task.name, refresh=False)
        info = {
            "base_model": spec.base_model_id,
            "task": task.name,
            "label_names": task.label_names,
            "num_labels": task.num_labels,
            "strategy": spec.strategy.name,
            "strategy_paper": spec.strategy.paper,
            "peft_method": spec.config.peft_method,
            "metrics": {task.name: metrics[task.name]},
            "hyperparameters": {**spec.strategy.hyperparameters(), **_training_hparams(spec)},
            "rounds": results["rounds"],
            "num_clients": results["num_clients"],
            "participation": spec.config.participation,
            **({"privacy": results["privacy"]} if "privacy" in results else {}),
            "bytes_communicated": results["bytes_uplink"] + results["bytes_downlink"],
            "modality": spec.card_modality(task),
            **spec.prompt_info(task),
            "extra_notes": " ".join(filter(None, [
                (f"Inputs are tokenized with truncation to {spec.config.max_length} tokens." if task.modality == "text"
                 else "Images are converted to RGB, then prepared by the base model's image processor."),
                subset_note(spec.config, results["tasks"][task.name]),
                unlearning_note(results), linearization_note(results, task.name),
                spec.output_space.describe(task.name) if spec.output_space else None])),
        }
        cards[task.name] = render_model_card(info)
        params = spec.task_view(spec.strategy.task_parameters(state, task.name, spec.stores), task.name)
        save_adapter(run_dir / ADAPTERS_DIR / task.name, peft_config=peft_config, state_dict=params,
                     base_model_id=spec.base_model_id, card=cards[task.name],
                     classifier_config=spec.labelled_config(task),
                     processor=spec.processor, metadata=spec.metadata(task, results, metrics[task.name]))
        point = spec.strategy.linearization_point(state, task.name) if "linearized" in exports else None
        if point is not None:  # None: a phase without one (nothing linearized to export yet)
            point = spec.task_view(point, task.name)
            save_linearized(run_dir / LINEARIZED_DIR / task.name, peft_config=peft_config, point=point,
                            delta=params - point, base_model_id=spec.base_model_id, num_labels=task.num_labels,
                            mode=spec.strategy.linearization,
                            info={"task": task.name, "metrics": {k: v for k, v in results["tasks"][task.name].items()
                                                                 if k.startswith(task.metric)}})
        bar.update()
    if "tct" in exports:
        for task in spec.tasks:
            package = spec.strategy.package(state, task.name)
            if package is not None:
                network, linear = package
                r = results["tasks"][task.name]
                save_tct(run_dir / TCT_DIR / task.name, peft_config=peft_config, network=network, linear=linear,
                         base_model_id=spec.base_model_id, card=_tct_card(spec, task, r, results),
                         info={"task": task.name, "label_names": task.label_names,
                               "metrics": {task.metric: r[task.metric]}})
        bar.update()
    if "multi_adapter" in exports:
        save_multi_adapter(run_dir / MULTI_ADAPTER_DIR, peft_config=peft_config,
                           task_states={t.name: spec.task_view(spec.strategy.task_parameters(state, t.name), t.name)
                                        for t in spec.tasks},
                           label_names={t.name: t.label_names for t in spec.tasks}, base_model_id=spec.base_model_id,
                           card=str(_multi_adapter_card(spec, results, metrics)),
                           classifier_configs={t.name: spec.labelled_config(t) for t in spec.tasks},
                           processor=spec.processor,
                           metadata={t.name: spec.metadata(t, results, metrics[t.name]) for t in spec.tasks})
        bar.update()
    if "compact" not in exports:
        return None
    compact = save_compact(
        run_dir / COMPACT_DIR,
        peft_config=peft_config,
        base_model_id=spec.base_model_id,
        **spec.strategy.compact_form(state),
        label_names={t.name: t.label_names for t in spec.tasks},
        **({"head_rows": spec.output_space.rows, "head_keys": spec.head_keys}
           if spec.output_space is not None and spec.output_space.shared else {}),
        card=_compact_card(spec, results),
        overwrite=True,
    )
    bar.update()
    return compact


def subset_note(config: RunConfig, result: dict) -> str | None:
    """The card's account of a capped test split (`max_test_samples`): the metric is of a seeded subset."""
    if not config.max_test_samples:
        return None
    return (f"The test {result['metric']} is of a seeded subset of {result.get('num_examples', '?')} test examples "
            f"(max_test_samples={config.max_test_samples}, seed {config.seed}), not the whole test split; "
            "`hf-fedtask evaluate` scores the same subset by default (`--max-test-samples all`: the whole split).")


def unlearning_note(results: dict) -> str | None:
    """The card's account of a removed task: which, how, from which round, and its metric before/after."""
    u = results.get("unlearning")
    if not u:
        return None
    shown = u["tasks"] or list(results["tasks"])  # a removed client: every task's change
    metric = {t: [results["tasks"][t]["metric"], *([BACKDOOR_METRIC] if BACKDOOR_METRIC in u["after"][t] else [])]
              for t in shown}
    change = "; ".join(
        f"`{t}` {m} {u['before'][t][m]:.4f} → {u['after'][t][m]:.4f}" if u.get("before")
        else f"`{t}` {m} {u['after'][t][m]:.4f}" for t in shown for m in metric[t])
    if "how" in u:
        how = u["how"]
    elif "from_round" in u:
        how = (f"in rounds {u['from_round']}–{u['from_round'] + u['rounds'] - 1} the updates of "
               f"{len(u['clients'])} client(s) ({', '.join(map(str, u['clients']))}) were negated before "
               "aggregation (NTKFedAvg Alg. 1, lines 8–9)")
    else:
        how = (f"its accumulated task vector, scaled by {u['scale']}, was subtracted from the merged model "
               "(task arithmetic)")
    after = f" Before → after: {change}." if change else ""
    return f"**Unlearned {forgotten_what(u, quote='`')}**: {how}.{after}"


def linearization_note(results: dict, task: str) -> str | None:
    """For linearized strategies: which metric belongs to which artifact."""
    r = results["tasks"][task]
    metric = r["metric"]
    if f"{metric}_nonlinear" not in r:
        return None
    return (f"**Linearized training.** The clients trained the linearization f(θ_lin) + J(θ_lin)·(θ − θ_lin). "
            f"This folder holds the final θ as an ordinary (non-linear) adapter: {metric} "
            f"{r[f'{metric}_nonlinear']:.4f}. "
            f"The linearized model itself ({metric} {r[metric]:.4f}) is exported as `linearized/{task}/` of the run "
            "(θ_lin adapter + delta; load it with `hf_fedtask.load_linearized`).")


def _multi_adapter_card(spec: RunExport, results: dict, metrics: dict) -> str:
    first = spec.tasks[0]
    same = [t.name for t in spec.tasks[1:] if t.num_labels == first.num_labels]
    other = next((t for t in spec.tasks if t.num_labels != first.num_labels), None)
    auto = "AutoModelForImageClassification" if first.modality == "image" else "AutoModelForSequenceClassification"
    snippet = (f"```python\nbase = {auto}.from_pretrained(\"{spec.base_model_id}\", "
               f"num_labels={first.num_labels})\n"
               f"model = PeftModel.from_pretrained(base, \"<this folder>\", adapter_name=\"{first.name}\")\n"
               f"model.load_adapter(\"<this folder>/{same[0] if same else '<task>'}\", "
               f"adapter_name=\"{same[0] if same else '<task>'}\")  # a task with {first.num_labels} labels\n"
               f"model.set_adapter(\"{same[0] if same else '<task>'}\")\n```")
    sizes = ("" if other is None else
             f"A task with another number of labels (e.g. `{other.name}`, {other.num_labels}) loads onto its own "
             f"base, like any exported adapter: `{auto}.from_pretrained(\"<this folder>/"
             f"{other.name}\", config=AutoConfig.from_pretrained(\"<this folder>/{other.name}\", "
             "subfolder=\"classifier\"))`: PEFT copies the base's one classifier for every adapter it holds, so "
             "adapters whose heads differ in size cannot share a model.")
    info = {
        "base_model": spec.base_model_id,
        "task": [t.name for t in spec.tasks],
        "num_labels": max(t.num_labels for t in spec.tasks),  # the summary's "into N classes": at most N
        "strategy": spec.strategy.name,
        "strategy_paper": spec.strategy.paper,
        "peft_method": spec.config.peft_method,
        "metrics": metrics,
        "hyperparameters": {**spec.strategy.hyperparameters(), **_training_hparams(spec)},
        "rounds": results["rounds"],
        "num_clients": results["num_clients"],
        "participation": spec.config.participation,
        **({"privacy": results["privacy"]} if "privacy" in results else {}),
        "bytes_communicated": results["bytes_uplink"] + results["bytes_downlink"],
        "modality": spec.card_modality(spec.tasks[0]),
        "extra_notes": (f"**One adapter per task** (PEFT multi-adapter layout): `{first.name}` at the root, every "
                        "other task in its subfolder, `tasks.json` lists them with their number of labels and label "
                        f"names. Sharing variant: `{spec.strategy.config.share}`. Each task's head has its task's own "
                        "number of labels, and each folder carries its tokenizer (or image processor) and "
                        f"`classifier/config.json`. Load and switch:\n\n{snippet}\n\n{sizes}".rstrip()),
    }
    return render_model_card(info)


def _compact_card(spec: RunExport, results: dict) -> str:
    # the compact form's own metric (its decoding loses some accuracy to unification), beside the task's adapter's
    rows = "\n".join(f"| {name} | {r.get(r['metric'] + '_compact', r[r['metric']]):.4f} | {r[r['metric']]:.4f} |"
                     for name, r in results["tasks"].items())
    return (f"# {spec.strategy.name} compact export of {len(spec.tasks)} tasks\n\n"
            f"Base model `{spec.base_model_id}`. Task t's adapter is θ_p + λ_t·(m_t ⊙ τ) plus its head:\n\n"
            "```python\nfrom hf_fedtask import load_task_adapter\n"
            "model = load_task_adapter(\"<this folder>\", \"<task>\")\n```\n\n"
            f"Total communication during training: {results['bytes_uplink'] + results['bytes_downlink']} bytes.\n\n"
            f"| task | metric (this compact form) | metric (the task's own adapter) |\n|---|---|---|\n{rows}\n")


def _tct_card(spec: RunExport, task, r: dict, results: dict) -> str:
    c = spec.strategy.config
    return f"""---
library_name: peft
base_model: {spec.base_model_id}
tags: [hf-fedtask, federated-learning, tct, entk]
---

# {task.name}: TCT (Train-Convexify-Train) stage-2 model

Trained with hf_fedtask by TCT ({spec.strategy.paper}) on {results["num_clients"]}
clients for {results["rounds"]} rounds: {c.stage1_rounds} FedAvg rounds (stage 1), one round that
standardized the features with the federation's mean and std, then federated linear regression
with the `{c.solver}` solver ({c.stage2_steps} local full-batch steps per round).

This is **not a plain adapter**. The prediction for an input x is argmax_j (z̃(x)ᵀW + b)_j, where z(x)
is the gradient of the first output of `feature_network/` (the stage-1 network
`{spec.base_model_id}` + its PEFT modules at the end of stage 1, with a re-initialized head) with
respect to its trainable parameters, restricted to (at most) {c.num_features}
seeded coordinates in `linear.safetensors` (`index`), and z̃ = (z − mean)/std.

- labels: {", ".join(task.label_names)}
- test {task.metric}: {r[task.metric]:.4f}

```python
from hf_fedtask.export.tct import load_tct
model = load_tct("path/to/this/folder")
model.predict([...])   # raw texts or PIL images -> label names
```
"""


def _training_hparams(spec: RunExport) -> dict:
    c = spec.config
    keys = ("peft_method", "lora_r", "lora_alpha", "local_epochs", "local_steps", "batch_size", "learning_rate",
            "lr_scheduler", "zeta", "partition", "seed")
    annealed = ("lr_round_schedule", "learning_rate_min") if c.lr_round_schedule != "constant" else ()
    return {k: getattr(c, k) for k in (*keys[:7], *annealed, *keys[7:])}


