"""results.json: what a finished run reports, summarized from its final state and round history.

Per task: the final metric, normalized by the shipped individual-centralized reference where one
exists, and the storage-saving export's own metric beside it; for the run: the means, bytes and
parameters sent, the hardware, and (for a run that unlearned) what was forgotten, from which round
and with what effect. `task_infos` reads the task metadata back, so that work on a finished run needs
no data.
"""

from __future__ import annotations

import numpy as np

from hf_fedtask.core.state import SHARED, GlobalState
from hf_fedtask.data.reference import shipped_reference
from hf_fedtask.data.task import TaskInfo
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.server import Server, nonlinear_mean
from hf_fedtask.engine.transport import Transport
from hf_fedtask.model.device import launch, peak_gpu_memory
from hf_fedtask.privacy.report import privacy_results
from hf_fedtask.report import evaluated, forgetting


def summarize_results(env: Environment, state: GlobalState, history: list[dict], transport: Transport | None = None,
                      stores: dict | None = None) -> dict:
    """results.json: final per-task metrics (normalized by the shipped individual-centralized
    reference where one exists for the task and base model) and the run's metadata."""
    config, strategy = env.config, env.strategy
    final = history[-1]["eval"] if history and "eval" in history[-1] else Server(env).evaluate(state, transport, stores)
    compact = Server(env).evaluate_compact(state)  # the storage-saving export's own accuracy, reported beside
    generated = Server(env).evaluate_generation(state, stores) if config.generation_eval else {}
    reference = shipped_reference(config.base_model)
    tasks = {}
    for t in env.tasks:
        r = {**final[t.name], "metric": t.metric, "num_labels": t.num_labels, "label_names": t.label_names,
             "chance": t.chance, "group": t.group, **({"instruction": t.instruction} if t.instruction else {})}
        if t.name in compact:
            r[f"{t.metric}_compact"] = compact[t.name]
        r.update(generated.get(t.name, {}))  # exact_match, or a free-text task's rougeL
        if t.name in reference and reference[t.name].get(t.metric):
            r["individual_centralized"] = reference[t.name][t.metric]
            r["normalized"] = r[t.metric] / r["individual_centralized"]
            if t.name in compact:
                r["normalized_compact"] = compact[t.name] / r["individual_centralized"]
        tasks[t.name] = r
    normalized = [r["normalized"] for r in tasks.values() if "normalized" in r]
    summary_extra = {"mean_metric_compact": float(np.mean(list(compact.values())))} if compact else {}
    for key in ("exact_match", "rougeL"):
        values = [g[key] for g in generated.values() if key in g]
        if values:
            summary_extra[f"mean_{key}"] = float(np.mean(values))
    if compact and len(normalized) == len(tasks):
        summary_extra["mean_normalized_compact"] = float(np.mean([r["normalized_compact"] for r in tasks.values()]))
    return {
        "strategy": strategy.name,
        "strategy_paper": strategy.paper,
        "hyperparameters": strategy.hyperparameters(),
        "config": config.to_dict(),
        "base_model": env.host.base.model_id,
        "base_model_revision": env.host.base.revision,
        "peft_method": config.peft_method,
        "device": str(env.host.device),
        "processes": launch().world_size,
        **({"peak_gpu_memory": gpu} if (gpu := peak_gpu_memory()) is not None else {}),
        "rounds": state.round,
        "num_clients": len(state.allocation),
        "allocation": {str(c): held for c, held in sorted(state.allocation.items())},
        "tasks": tasks,
        "mean_metric": float(np.mean([r[r["metric"]] for r in tasks.values()])),
        **nonlinear_mean(final, env.tasks),
        "mean_normalized": float(np.mean(normalized)) if len(normalized) == len(tasks) else None,
        **summary_extra,
        "bytes_uplink": sum(h["bytes_uplink"] for h in history),
        "bytes_downlink": sum(h["bytes_downlink"] for h in history),
        "shared_parameters": sum(t.numel() for t in state.vectors.get(SHARED, {}).values()),
        **{k: sum(h.get(k, 0) for h in history) for k in ("params_uplink", "params_downlink")},  # T x M x P
        **unlearning_summary(history, env, state),
        **privacy_results(Server(env).privacy, history),
    }


def unlearning_summary(history: list[dict], env: Environment, state: GlobalState) -> dict:
    """`{"unlearning": ...}` for a run that negated the forgotten tasks' or clients' updates: from
    which round, by how many clients, and each task's metric before and after (empty otherwise)."""
    if not env.strategy.capabilities.federated_unlearning:
        return {}
    options = env.strategy.config
    forget, forget_clients = options.forget_tasks or [], options.forget_clients or []
    first = next((h for h in history if forgetting(h)), None)
    if first is None:
        return {}
    before = next((h for h in reversed(evaluated(history)) if h["round"] < first["round"]), None)
    holders = sorted({c for c, tasks in state.allocation.items() if set(tasks) & set(forget)} | set(forget_clients))
    return {"unlearning": {
        "method": "federated: the updates of the forgotten clients (and of the clients holding the forgotten tasks) "
                  "were negated before aggregation",
        "tasks": forget,
        "forgotten_clients": forget_clients,
        "clients": holders,
        "from_round": first["round"],
        "rounds": history[-1]["round"] - first["round"] + 1,
        "before": {t: before["eval"][t] for t in before["eval"]} if before else None,
        "after": evaluated(history)[-1]["eval"],
    }}


def task_infos(results: dict, modality: str) -> list[TaskInfo]:
    """The tasks a results.json describes (label names, metric, chance, group), without their data."""
    return [TaskInfo(name, tuple(r["label_names"]), r["metric"], modality, r.get("chance"), r.get("group"),
                     r.get("instruction", ""))
            for name, r in results["tasks"].items()]
