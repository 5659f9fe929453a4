"""F²L²'s backdoor protocol: federated linear training with one backdoored client, then its removal
on the server alone, against retraining without it and the baselines.

    apt-get install dataset-fashion-mnist          # the data, offline (or the Hub copy, online)
    python recipes/f2l2_backdoor.py                # Fashion-MNIST, the paper's MLP, 3 IID clients, 9,000 images
    python recipes/f2l2_backdoor.py --tasks digits --backdoor-trigger 3 --num-clients 3 --rounds 11 --local-epochs 3
    python recipes/f2l2_backdoor.py --seeds 0 1 2 --output-dir runs/f2l2_mlp_seeds  # a protocol per seed, their mean
    python recipes/f2l2_backdoor.py --linear-solver cg --l2 0.01 --rounds 501 --negation-rounds 0  # to the optimum

Client 0's training data all carry a white square at the bottom right (`--backdoor-trigger` pixels)
and label 0. Three clients, because with 5 (30 rounds, 1 local epoch) the backdoor plateaued at BSR ≈
50%. Runs: `trained` (F²L²: the server pretrains on its 10% slice, FedAvg of the linearized MLP, the
last round collects each client's gradient) and `retrained` (the same without client 0; with
`--retrain-orders` k, k more retrainings in other training orders, `training_seed`, on the same partition
and w₀: retraining's own run-to-run spread, the yardstick for the removal's gaps; the table says whether the
other orders are within the goal of the first, i.e. whether the window can judge a removal at all, and whether
the default lands inside the retrainings' range widened by the window). Removals of
client 0 from `trained`: F²L² with its defaults (damping λ = ρ·λ_max(H_s), the auto form of the gradient
inside the trust region), the difference form with and without the region, the split form with the other
ρ of `--rhos` and with an absolute λ = 10 (`--l2s`), the split, target and retained forms at the default
damping (the anchored, difference, target and retained forms swept over `--rhos` too with `--forms`), and the SGA
baseline (the client ascends its own loss); the project's own
removal, `--negation-rounds` of federated negation after a FedAvg run on the same data, as another. Writes
`<output_dir>/f2l2_backdoor.md` (clean test accuracy TA, backdoor success rate BSR on triggered
test images of the other classes, BSR on the client's poisoned training set as the official code
measures it, the gaps to retraining, ‖w − w_retrain‖, the form of the gradient and the damping λ used,
removal time over one training round's and over the retraining's training rounds, and client messages), the split of the
distance to retraining into the Hessian approximation's share (the same step with the retained
clients' own Hessian, which only a simulation can compute, also evaluated as the table's last row) and the
rest, `f2l2_backdoor.json` and
`f2l2_backdoor.png`. Finished runs in `<output_dir>` are reused: the removals alone take seconds. With
`--seeds`, each seed's protocol (its own partition, pretraining and training) goes to
`<output_dir>/seed_<s>/`, and `<output_dir>/f2l2_backdoor.md` holds each row's mean ± std over the seeds and
on how many seeds it is within the goal (TA within 1 point and BSR within 2 of that seed's retraining).
With `--linear-solver cg` (and l2 > 0) training and retraining run federated conjugate gradient to their
objectives' minimizers, one round per iteration, and the recipe leaves out its local optimizer defaults, which
that solver refuses; the table then adds the retained form at the objective's λ = l2.
"""

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
from datasets import concatenate_datasets  # noqa: E402

from hf_fedtask.config import RunConfig  # noqa: E402
from hf_fedtask.core.files import write_atomic  # noqa: E402
from hf_fedtask.core.taskvector import TaskVector  # noqa: E402
from hf_fedtask.data.backdoor import GOAL_BSR, GOAL_TA, inside_spread, within_goal  # noqa: E402
from hf_fedtask.data.backdoor import METRIC as BSR  # noqa: E402
from hf_fedtask.engine.run import run  # noqa: E402
from hf_fedtask.engine.run_folder import open_finished_run, read_history  # noqa: E402
from hf_fedtask.engine.server import Server  # noqa: E402
from hf_fedtask.errors import ConfigError, FedTaskError  # noqa: E402
from hf_fedtask.report import pyplot  # noqa: E402
from hf_fedtask.strategies.base import task_model, task_vectors  # noqa: E402
from hf_fedtask.strategies.f2l2 import LOCAL_TRAINING, RemovalOptions  # noqa: E402
from hf_fedtask.workflows.compare import finished_results  # noqa: E402
from hf_fedtask.workflows.recipe import publish_results, recipe_config, recipe_parser, resource_report  # noqa: E402
from hf_fedtask.workflows.unlearn import REMOVED_MODEL, remove_client, unlearn  # noqa: E402

DEFAULTS = {
    "tasks": ["fashion_mnist"],
    "suite": None,
    "base_model": "hf-fedtask/small-mlp",
    "peft_method": "full",
    "strategy": "f2l2",
    "num_clients": 3,  # with 5 the backdoor stays too weak to show its removal (see the docstring)
    "partition": "iid",
    "rounds": 11,  # 10 training rounds and the gradient round
    "max_train_samples": 9000,
    "max_test_samples": 2000,
    "local_epochs": 2.0,
    "batch_size": 32,
    "optimizer": "adamw_torch",
    "learning_rate": 3e-4,
    "lr_scheduler": "constant",
    "eval_batch_size": 512,
    "backdoor_client": 0,
    "backdoor_target": 0,
    "backdoor_trigger": 7,
    "export": False,
    "output_dir": "runs/f2l2_backdoor",
}
RHOS = (0.001, 0.003, 0.01, 0.03, 0.1)  # besides the default ρ, the sweep it was chosen from (0.003: the former)
L2S = (10.0,)  # absolute λ: the former default


def removals(strategy_config, rhos, l2s, forms=()) -> dict[str, dict]:
    """The removals of the table, by row name -> `remove_client` keywords (the first: the run's defaults, the
    auto form inside the trust region; then the difference form with the region and without it); `forms`:
    gradient forms swept over `rhos` besides the split form (what auto takes where the difference step fits).
    The sweeps run without the trust region, the default-damping rows with it."""
    c = strategy_config
    # auto damping is relative on an objective without l2 or a ridge (the paper's)
    relative = c.removal_damping == "relative" or (c.removal_damping == "auto" and c.l2 == 0 and c.ridge == 0)
    default_rho = c.removal_rho if relative else None
    own = f"ρ={c.removal_rho:g}" if relative else {"auto": "auto damping", "absolute": f"λ={c.removal_l2:g} absolute",
                                                    "objective": "the objective's λ"}[c.removal_damping]
    free = {"trust_radius": 0.0}  # the sweeps show each damping as it is, without the trust region
    rows = {f"f2l2 (default: auto form, {own})": {}}
    if c.curvature_rank:  # the run's clients uploaded curvature factors: the default takes their Hessian
        rows[f"f2l2 auto form ({own}), the server's Hessian H_s"] = {"hessian": "server"}
    rows[f"f2l2 difference form ({own})"] = {"gradient": "difference"}
    if c.removal_trust_radius:
        rows[f"f2l2 difference form ({own}, no trust region)"] = {"gradient": "difference", **free}
    rows.update({f"f2l2 split (ρ={rho:g})": {"rho": rho, "gradient": "split", **free}
                 for rho in rhos if rho != default_rho})
    rows.update({f"f2l2 split (λ={l2:g} absolute)": {"l2": l2, "gradient": "split", **free} for l2 in l2s})
    rows.update({f"f2l2 {form} (default damping)": {"gradient": form} for form in ("split", "target", "retained")})
    if c.l2 > 0 and c.ridge == 0:  # the objective's own λ, whatever the auto damping reads from the uploads
        rows[f"f2l2 retained (the objective's λ = l2 = {c.l2:g})"] = {"gradient": "retained", "l2": c.l2}
    rows.update({f"f2l2 {form} (ρ={rho:g})": {"gradient": form, "rho": rho, **free}
                 for form in forms for rho in rhos if rho != default_rho})
    rows["SGA"] = {"method": "sga", "sga_lr": 1e-2}
    return rows


def poisoned_bsr(env, state, client: int, task: str) -> float:
    """The official code's BSR: the share of the target client's (poisoned) training set put in the target class."""
    preds = Server(env).predict(state, task, env.client_data(client)[task])
    return float(np.mean(preds == env.config.backdoor_target))


def negation_rows(base: RunConfig, out: Path, target: int, task: str, rounds: int) -> dict:
    """The project's own client removal as a baseline: FedAvg trains the ordinary (non-linear) model
    on the same data, then `rounds` more rounds negate the target client's updates (NTKFedAvg's
    federated unlearning). Its models are not linearized at w₀, so no distance to F²L²'s retraining."""
    # F²L²'s linear_solver cg runs without the recipe's local optimizer defaults; the FedAvg baseline needs them
    cg = base.strategy_options.get("linear_solver") == "cg"
    local = {k: DEFAULTS[k] for k in LOCAL_TRAINING if k in DEFAULTS} if cg else {}
    config = RunConfig.from_dict({**base.to_dict(), **local, "strategy": "fedavg", "strategy_options": {},
                                  "output_dir": str(out / "fedavg_trained")}, source="recipe")
    finished_results(config) or run(config, resume=(Path(config.output_dir) / "checkpoint.safetensors").exists())
    negated = out / "fedavg_negated"
    if not (negated / "results.json").exists():
        unlearn(out / "fedavg_trained", None, rounds, client=target, output_dir=negated,
                resume=(negated / "checkpoint.safetensors").exists())
    rows = {}
    for name, folder in {"FedAvg trained": out / "fedavg_trained",
                         f"FedAvg + negation ({rounds} rounds)": negated}.items():
        finished = open_finished_run(folder)
        evals = Server(finished.env).evaluate(finished.state)[task]
        rows[name] = {"ta": evals["accuracy"], "bsr": evals[BSR], "w": None,
                      "bsr_train": poisoned_bsr(finished.env, finished.state, target, task)}
    history = read_history(negated)
    rows[f"FedAvg + negation ({rounds} rounds)"].update(messages=rounds * base.num_clients,
                                                         seconds=sum(r["seconds"] for r in history[-rounds:]))
    return rows


DEFAULT_ROW = "f2l2 (default"  # the row of F²L²'s defaults starts so
ORDER_STRIDE = 10_000  # training_seed of a retraining's order j: seed + j·ORDER_STRIDE (clear of other seeds)


def evaluated(env, state, target: int, task: str, **extra) -> dict:
    """A table row's measurements of `state`: TA, BSR on the triggered test set and on the client's poisoned set."""
    evals = Server(env).evaluate(state)[task]
    return {"ta": evals["accuracy"], "bsr": evals[BSR], "bsr_train": poisoned_bsr(env, state, target, task), **extra}


def protocol(base: RunConfig, args) -> dict:
    """One seed's protocol in `base.output_dir`: the runs (reused when finished), the removals, the table
    (`f2l2_backdoor.md`, `.json`, `.png`); returns what the JSON holds."""
    out = Path(base.output_dir)
    target = base.backdoor_client
    configs = {"trained": RunConfig.from_dict({**base.to_dict(), "output_dir": str(out / "trained")},
                                              source="recipe"),
               "retrained": RunConfig.from_dict({**base.to_dict(), "output_dir": str(out / "retrained"),
                                                 "exclude_clients": [target]}, source="recipe")}
    for j in range(1, args.retrain_orders + 1):  # the same retraining in other training orders: its own spread
        configs[f"retrained, training order {j + 1}"] = RunConfig.from_dict(
            {**base.to_dict(), "output_dir": str(out / f"retrained_order{j + 1}"), "exclude_clients": [target],
             "training_seed": base.seed + j * ORDER_STRIDE}, source="recipe")
    for config in configs.values():
        finished_results(config) or run(config, resume=(Path(config.output_dir) / "checkpoint.safetensors").exists())
    finished = {name: open_finished_run(config.output_dir) for name, config in configs.items()}
    trained, retrained = finished["trained"], finished["retrained"]
    env, task = trained.env, trained.env.tasks[0].name
    rows = {name: evaluated(env, run_.state, target, task, w=task_model(run_.state.vectors, task))
            for name, run_ in finished.items()}  # trained, retrained, then the other orders
    orders = [name for name in rows if name.startswith("retrained")]
    round_s = statistics.median(r["seconds"] for r in trained.history[:-1])  # all but the gradient round
    # what retraining costs: the retrained run's training rounds (round 1 holds the server's pretraining;
    # each round's evaluation is included, as it is in one round's time above; linear_solver cg's are queries)
    retrain_s = sum(r["seconds"] for r in retrained.history[:-1])
    plan = removals(env.strategy.config, args.rhos, args.l2s, args.forms)
    for name, options in plan.items():
        folder = out / "removed" / name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "")
        results = remove_client(out / "trained", target, output_dir=folder, overwrite=True, **options)
        u = results["unlearning"]
        w = TaskVector.load(folder / REMOVED_MODEL)
        removed_state = trained.state.next(task_vectors(w, trained.state.vectors, task))
        rows[name] = {"ta": u["after"][task]["accuracy"], "bsr": u["after"][task][BSR],
                      "bsr_train": poisoned_bsr(env, removed_state, target, task), "w": w,
                      "seconds": u["seconds"], "messages": u["client_messages"], "form": u.get("form"),
                      "residual": u.get("relative_residual"), "lambda": u.get("l2"),
                      "lambda_max": u.get("lambda_max"), "rho": u.get("rho"),
                      "cg_iterations": u.get("cg_iterations"), "eigen_iterations": u.get("eigen_iterations"),
                      "hessian": u.get("hessian")}
    if args.negation_rounds:
        rows.update(negation_rows(base, out, target, task, args.negation_rounds))
    # the bound's two error terms, measured: the same step with the retained clients' own Hessian H₋
    # (which the server does not have) against F²L²'s H_s, and that step against retraining
    retained = [k for k in range(env.num_clients) if k != target]
    retained_data = env.host.tokenize(concatenate_datasets([env.partition[k][task] for k in retained]),
                                      env.task_by_name[task])
    # both at the default damping as it is, in the form the default removal took: the Hessians' gap alone
    first = rows[next(iter(plan))]
    raw = RemovalOptions(gradient=first["form"], trust_radius=0.0, hessian="server")
    oracle = env.strategy.remove_client(trained.state, env, target, raw, hessian_data=retained_data)
    default = env.strategy.remove_client(trained.state, env, target,  # with the Hessian the default took
                                         dataclasses.replace(raw, hessian=first["hessian"] or "server"))
    w_oracle, w_default = task_model(oracle.state.vectors, task), task_model(default.state.vectors, task)
    rows["f2l2 default form and damping, the retained clients' own Hessian (simulation only)"] = evaluated(
        env, oracle.state, target, task, w=w_oracle, form=oracle.form, hessian="retained data",
        **{"lambda": oracle.l2})
    decomposition = {"form": default.form, "hessian": default.hessian, "lambda": default.l2,
                     "lambda_max": default.lambda_max,
                     "rho": default.rho,
                     "hessian_error": (w_default - w_oracle).norm(),
                     "exact_step_to_retrain": (w_oracle - rows["retrained"]["w"]).norm(),
                     "f2l2_to_retrain": (w_default - rows["retrained"]["w"]).norm()}
    ref = rows["retrained"]
    lambda_max = next((f"{r['lambda_max']:.4g}" for r in rows.values() if r.get("lambda_max")), "not computed")
    trigger = (f"{base.backdoor_trigger}×{base.backdoor_trigger} white square" if env.host.inputs.modality == "image"
               else f"{base.backdoor_trigger} trigger word(s) 'cf'")
    lam_r = env.strategy.ridge_lambda(trained.state)
    ridge = (f"; trained with the ridge (λ_r/2)·‖w − w₀‖², λ_r = {env.strategy.config.ridge:g}·λ_max(H_s at w₀) = "
             f"{lam_r:.4g}" if lam_r else "")
    lines = [f"**{task}, {base.num_clients} IID clients (client {target} backdoored: {trigger}, label "
             f"{base.backdoor_target}), {base.base_model} ({base.peft_method}) linearized at the server's pretrained "
             f"w₀, {base.rounds - 1} training rounds + the gradient round, seed {base.seed}; one training round "
             f"{round_s:.2f} s, retraining's training rounds {retrain_s:.1f} s; λ_max(H_s) = {lambda_max}{ridge}**", "",
             "| model | TA % | BSR % (test) | BSR % (client's poisoned set) | ΔTA to retrain | ΔBSR to retrain "
             "| ‖w − w_retrain‖ | form of g | Hessian | λ | removal time / round | removal time / retraining "
             "| client messages |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        timing = f"{r['seconds'] / round_s:.2f}" if "seconds" in r else "-"
        share = f"{r['seconds'] / retrain_s:.4f}" if "seconds" in r else "-"
        messages = str(r["messages"]) if "messages" in r else "-"
        distance = f"{(r['w'] - ref['w']).norm():.2f}" if r["w"] is not None else "-"
        lam = f"{r['lambda']:.4g}" if r.get("lambda") is not None else "-"
        lines.append(f"| {name} | {100 * r['ta']:.1f} | {100 * r['bsr']:.1f} | {100 * r['bsr_train']:.1f} "
                     f"| {100 * (r['ta'] - ref['ta']):+.1f} | {100 * (r['bsr'] - ref['bsr']):+.1f} "
                     f"| {distance} | {r.get('form') or '-'} | {r.get('hessian') or '-'} | {lam} | {timing} | {share} "
                     f"| {messages} |")
    d = decomposition
    stand_in = ("H_s from the server's slice" if d["hessian"] == "server" else
                "H₋ from the curvature factors the clients uploaded")
    lines += ["", f"Where the distance to retraining comes from ({d['form']} form, λ = {d['lambda']:.4g}): "
              f"‖w_F²L² − w_exact‖ = {d['hessian_error']:.3f} is the Hessian approximation ({stand_in} instead "
              f"of the retained clients' H₋ from their data), ‖w_exact − w_retrain‖ = "
              f"{d['exact_step_to_retrain']:.3f} is the rest "
              f"(training not at its optimum, the damping λ); ‖w_F²L² − w_retrain‖ = {d['f2l2_to_retrain']:.3f}."]
    (default_name,) = [name for name in rows if name.startswith(DEFAULT_ROW)]
    spread = {"ta": [100 * rows[n]["ta"] for n in orders], "bsr": [100 * rows[n]["bsr"] for n in orders]}
    met = [within_goal(rows[default_name], rows[n]) for n in orders]
    # retraining against itself: the other orders within the goal of the first (can the window judge here?)
    self_met = [within_goal(rows[n], rows[orders[0]]) for n in orders[1:]]
    inside = inside_spread(rows[default_name], [rows[n] for n in orders]) if len(orders) > 1 else None
    if len(orders) > 1:
        judge = ("so the window can judge a removal here" if all(self_met) else
                 "so the window is narrower than retraining's own spread and cannot tell a removal from a "
                 "retraining here")
        lines += ["", f"Retraining's own spread over {len(orders)} training orders (`training_seed`; the same "
                  f"partition, w₀ and server data): TA {min(spread['ta']):.1f}-{max(spread['ta']):.1f} (std "
                  f"{statistics.stdev(spread['ta']):.2f}), BSR {min(spread['bsr']):.1f}-{max(spread['bsr']):.1f}. "
                  f"The other orders are within the goal of the first in {sum(self_met)} of {len(self_met)}, "
                  f"{judge}. The default removal is within {GOAL_TA:g} point of TA and {GOAL_BSR:g} of BSR of "
                  f"{sum(met)} of them (of the first, {'yes' if met[0] else 'no'}), and "
                  f"{'inside' if inside else 'outside'} their range widened by that window."]
    text = "\n".join(lines) + "\n"
    write_atomic(out / "f2l2_backdoor.md", text)
    table = {name: {k: v for k, v in r.items() if k != "w"}
             | {"distance_to_retrain": (r["w"] - ref["w"]).norm() if r["w"] is not None else None}
             for name, r in rows.items()}
    report = {"seed": base.seed, "round_seconds": round_s, "retrain_seconds": retrain_s, "rows": table,
              "decomposition": decomposition, "retraining_orders": orders, "default_row": default_name,
              "default_within_goal": met, "retraining_within_goal": self_met, "default_inside_spread": inside}
    write_atomic(out / "f2l2_backdoor.json", json.dumps(report, indent=1) + "\n")
    bar_plot({name: (r["ta"], r["bsr"]) for name, r in rows.items()}, out / "f2l2_backdoor.png")
    print(text)
    return report


def bar_plot(values: dict[str, tuple[float, float]], path: Path, errors: dict | None = None) -> None:
    """TA and BSR per row (`errors`: their standard deviations over seeds), as bars."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    names = list(values)
    x = np.arange(len(names))
    for i, (offset, label) in enumerate([(-0.2, "TA (clean test accuracy)"), (0.2, "BSR (backdoor success)")]):
        ax.bar(x + offset, [100 * values[n][i] for n in names], 0.4, label=label,
               yerr=None if errors is None else [100 * errors[n][i] for n in names])
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("%")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def across_seeds(reports: list[dict], out: Path) -> str:
    """The seeds' tables in one (`<output_dir>/f2l2_backdoor.md`, `.json`, `.png`): each row's mean ± std over
    the seeds, its gaps to each seed's (first) retraining, and on how many seeds it is within the goal."""
    names = [name for name in reports[0]["rows"] if all(name in r["rows"] for r in reports)]
    lines = [f"**F²L²'s backdoor protocol over {len(reports)} seeds ({', '.join(str(r['seed']) for r in reports)}; "
             f"each seed its own partition, pretraining and training); mean ± std over the seeds**", "",
             "| model | TA % | BSR % (test) | ΔTA to retrain | ΔBSR to retrain | within the goal (seeds) "
             "| removal time / retraining |", "|---|---|---|---|---|---|---|"]
    summary = {}
    for name in names:
        rows = [r["rows"][name] for r in reports]
        refs = [r["rows"]["retrained"] for r in reports]
        ta, bsr = mean_std([100 * x["ta"] for x in rows]), mean_std([100 * x["bsr"] for x in rows])
        dta = mean_std([100 * (x["ta"] - y["ta"]) for x, y in zip(rows, refs)])
        dbsr = mean_std([100 * (x["bsr"] - y["bsr"]) for x, y in zip(rows, refs)])
        met = sum(within_goal(x, y) for x, y in zip(rows, refs))
        share = ([x["seconds"] / r["retrain_seconds"] for x, r in zip(rows, reports)] if "seconds" in rows[0]
                 else None)
        summary[name] = {"ta": ta, "bsr": bsr, "delta_ta": dta, "delta_bsr": dbsr, "within_goal": met,
                         "removal_over_retraining": share}
        lines.append(f"| {name} | {ta[0]:.1f} ± {ta[1]:.1f} | {bsr[0]:.1f} ± {bsr[1]:.1f} | {dta[0]:+.1f} ± "
                     f"{dta[1]:.1f} | {dbsr[0]:+.1f} ± {dbsr[1]:.1f} | {met} of {len(reports)} | "
                     + (f"{min(share):.3f}-{max(share):.3f}" if share else "-") + " |")
    goal = (f"The goal: TA within {GOAL_TA:g} point and BSR within {GOAL_BSR:g} points of the same seed's "
            f"retraining.")
    orders = [r for r in reports if len(r["retraining_orders"]) > 1]
    if orders:
        spreads = [statistics.stdev([100 * r["rows"][n]["ta"] for n in r["retraining_orders"]]) for r in orders]
        within = ", ".join(f"{sum(r['default_within_goal'])} of {len(r['default_within_goal'])}" for r in orders)
        judged = sum(all(r["retraining_within_goal"]) for r in orders)
        inside = sum(bool(r["default_inside_spread"]) for r in orders)
        goal += (f" Retraining's own TA spread over its training orders (std within a seed): "
                 f"{', '.join(f'{s:.2f}' for s in spreads)}; the default removal is within the goal of {within} "
                 f"of them. Retraining is within the goal of itself (every order of the first) on {judged} of "
                 f"{len(orders)} seeds; the default lands inside retraining's range widened by the window on "
                 f"{inside} of {len(orders)}.")
    text = "\n".join(lines + ["", goal]) + "\n"
    write_atomic(out / "f2l2_backdoor.md", text)
    write_atomic(out / "f2l2_backdoor.json", json.dumps({"seeds": [r["seed"] for r in reports], "rows": summary,
                                                        "per_seed": reports}, indent=1) + "\n")
    bar_plot({n: (s["ta"][0] / 100, s["bsr"][0] / 100) for n, s in summary.items()}, out / "f2l2_backdoor.png",
             errors={n: (s["ta"][1] / 100, s["bsr"][1] / 100) for n, s in summary.items()})
    return text


def main(argv=None) -> int:
    parser = recipe_parser(__doc__.splitlines()[0], {})
    parser.add_argument("--negation-rounds", type=int, default=5,
                        help="baseline: rounds of federated negation after a FedAvg run on the same data (0: skip)")
    parser.add_argument("--rhos", type=float, nargs="*", default=list(RHOS),
                        help="F²L² removals with λ = ρ·λ_max(H_s) for these ρ besides the run's default")
    parser.add_argument("--l2s", type=float, nargs="*", default=list(L2S),
                        help="F²L² removals with these absolute λ (the former default: 10)")
    parser.add_argument("--forms", nargs="*", choices=["anchored", "difference", "target", "retained"], default=[],
                        help="gradient forms to sweep over --rhos besides the split form (which always is)")
    parser.add_argument("--retrain-orders", type=int, default=2,
                        help="more retrainings in other training orders (`training_seed`), which measure "
                        "retraining's own spread (0: none)")
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="run the protocol once per seed, each in <output_dir>/seed_<s>, and tabulate the "
                        "seeds' mean ± std in <output_dir> (default: --seed alone, in <output_dir>)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.retrain_orders < 0:
            raise ConfigError(f"--retrain-orders must be >= 0, got {args.retrain_orders}")
        if args.seeds is not None and args.seed is not None:
            raise ConfigError("give --seed (one protocol) or --seeds (several), not both")
        if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
            raise ConfigError(f"--seeds repeats a seed: {' '.join(map(str, args.seeds))}")
        # linear_solver cg takes no local optimizer steps and refuses their options: the recipe's own are left out
        defaults = {k: v for k, v in DEFAULTS.items() if not (args.linear_solver == "cg" and k in LOCAL_TRAINING)}
        base = recipe_config(args, defaults, {})
        if args.seeds is None:
            protocol(base, args)
        else:
            out = Path(base.output_dir)
            reports = [protocol(RunConfig.from_dict({**base.to_dict(), "seed": seed,
                                                     "output_dir": str(out / f"seed_{seed}")}, source="recipe"),
                                args) for seed in args.seeds]
            print(across_seeds(reports, out))
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(resource_report(time.perf_counter() - start))
    publish_results(args, base.output_dir, (Path(base.output_dir) / "f2l2_backdoor.md").read_text(), argv, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
