"""F²L²'s removal with the retained clients' own Hessian from rank-k curvature factors, against the rank.

    python benchmarks/f2l2_curvature_rank.py runs/f2l2_text_3200 --ranks 64 128 256 512
    python benchmarks/f2l2_curvature_rank.py --quick     # its own small digits protocol, ranks 8 and 32

Takes a finished `recipes/f2l2_backdoor.py` output folder (its `trained` and `retrained` runs, trained without
`curvature_rank`), computes each client's factor as the run's gradient round would have with `curvature_rank`
= max(ranks) (`hf_fedtask.strategies.f2l2.client_curvature` over the client's own data at w₀; cached in
`<folder>/curvature_factors_<k>/`), keeps the top k rows for each k, and removes the backdoored client with
those factors (`hessian` clients) in the auto, retained, split, anchored, difference and target forms. Writes
`<folder>/curvature_rank.md` and `.json`: TA and BSR of each removal (and of the removal with the server's
H_s, the default without factors), their gaps to retraining, the form taken, ‖step‖ against the trust
radius, each client's k-th eigenvalue against the damping λ, and, where the folder holds retrainings in other
training orders (`--retrain-orders`), whether the removal lands inside their range widened by the goal's window;
`RATIO` lines: the removal time with the
factors over H_s's. What it saves over a rerun of the recipe: training the run again (the factors do not
change training, only the last round's upload).
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from hf_fedtask.config import RunConfig  # noqa: E402
from hf_fedtask.core.files import write_atomic  # noqa: E402
from hf_fedtask.core.state import GlobalState, curvature_name  # noqa: E402
from hf_fedtask.core.taskvector import TaskVector  # noqa: E402
from hf_fedtask.data.backdoor import GOAL_BSR, GOAL_TA, inside_spread  # noqa: E402
from hf_fedtask.data.backdoor import METRIC as BSR  # noqa: E402
from hf_fedtask.engine.run import run  # noqa: E402
from hf_fedtask.engine.run_folder import open_finished_run  # noqa: E402
from hf_fedtask.engine.server import Server  # noqa: E402
from hf_fedtask.strategies.base import task_model, task_point  # noqa: E402
from hf_fedtask.strategies.f2l2 import RemovalOptions, client_curvature  # noqa: E402

FORMS = ("auto", "retained", "split", "anchored", "difference", "target")
QUICK = dict(tasks=["digits"], suite=None, base_model="hf-fedtask/small-mlp", peft_method="full", strategy="f2l2",
             strategy_options={"pretrain_epochs": 5}, num_clients=3, rounds=4, local_epochs=1.0, batch_size=32,
             learning_rate=3e-4, lr_scheduler="constant", backdoor_client=0, backdoor_trigger=3, export=False)


def quick_protocol(folder: Path) -> None:
    """A small digits protocol (3 clients, 3 training rounds): `trained` and `retrained` without client 0."""
    run(RunConfig(**QUICK, output_dir=str(folder / "trained")))
    run(RunConfig(**QUICK, exclude_clients=[0], output_dir=str(folder / "retrained")))


def factors(env, state, task: str, rank: int, cache: Path, clients: list[int]) -> dict[int, TaskVector]:
    """`clients`' rank-`rank` curvature factors, as their gradient round computes them (cached)."""
    model, point = task_model(state.vectors, task), task_point(state.vectors, task)
    out = {}
    for client in clients:
        path = cache / f"client{client}.safetensors"
        if path.exists():
            out[client] = TaskVector.load(path)
            continue
        data = env.host.tokenize(env.partition[client][task], env.task_by_name[task])
        start = time.perf_counter()
        out[client] = client_curvature(env.host, model, point, data, rank, seed=client)
        print(f"client {client}: rank-{rank} factor in {time.perf_counter() - start:.1f} s", flush=True)
        cache.mkdir(parents=True, exist_ok=True)
        out[client].save(path)
    return out


def folder_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every script that measures a finished recipe folder takes: the folder and --threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("folder", type=Path, nargs="?", help="a finished recipes/f2l2_backdoor.py output folder")
    parser.add_argument("--threads", type=int, default=None)
    return parser


def on_folder(parser: argparse.ArgumentParser, args, measure, protocol=quick_protocol) -> None:
    """`measure(args)` with `args.folder` the given folder or, with --quick, the small `protocol`'s."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.folder is None and not args.quick:
        parser.error("give a finished recipes/f2l2_backdoor.py output folder (or --quick)")
    if args.folder is None:
        with tempfile.TemporaryDirectory() as tmp:
            args.folder = Path(tmp)
            protocol(args.folder)
            measure(args)
    else:
        measure(args)


def main() -> None:
    parser = folder_parser(__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="without a folder: a small digits protocol of its own in a temporary folder, ranks 8 32")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="default: 64 128 256 512 (--quick: 8 32)")
    args = parser.parse_args()
    args.ranks = args.ranks or ([8, 32] if args.quick else [64, 128, 256, 512])
    if min(args.ranks) < 1:
        parser.error(f"--ranks must be >= 1, got {min(args.ranks)}")
    on_folder(parser, args, measure)


def measure(args) -> None:
    """The removals with H_s (the baseline) and at each rank, their table and JSON in `args.folder`, and the
    removal time with the clients' factors over H_s's (auto form) as RATIO lines."""
    trained, retrained = open_finished_run(args.folder / "trained"), open_finished_run(args.folder / "retrained")
    env, state = trained.env, trained.state
    task, target = env.tasks[0].name, env.config.backdoor_client
    reference = Server(retrained.env).evaluate(retrained.state)[task]
    others = sorted(p.parent for p in args.folder.glob("retrained_order*/checkpoint.safetensors"))  # --retrain-orders
    evals = [reference] + [Server(o.env).evaluate(o.state)[task] for o in map(open_finished_run, others)]
    retrainings = [{"ta": e["accuracy"], "bsr": e[BSR]} for e in evals]
    top = max(args.ranks)
    retained = [c for c in range(env.num_clients) if c != target]  # the removal reads theirs alone
    full = factors(env, state, task, top, args.folder / f"curvature_factors_{top}", retained)
    rows = []

    def remove(rank, form: str, with_state, hessian: str) -> dict:
        start = time.perf_counter()
        removal = env.strategy.remove_client(with_state, env, target, RemovalOptions(gradient=form, hessian=hessian))
        seconds = time.perf_counter() - start
        evals = Server(env).evaluate(removal.state)[task]
        row = {"rank": rank, "gradient": form, "form": removal.form, "hessian": removal.hessian,
               "ta": evals["accuracy"], "bsr": evals[BSR],
               "delta_ta": 100 * (evals["accuracy"] - reference["accuracy"]),
               "delta_bsr": 100 * (evals[BSR] - reference[BSR]), "lambda": removal.l2, "step": removal.step_norm,
               "trust_radius": removal.trust_radius, "curvature_tail": removal.curvature_tail, "seconds": seconds}
        row["inside_spread"] = inside_spread(row, retrainings) if len(retrainings) > 1 else None
        print(json.dumps(row), flush=True)
        return row

    baseline = remove(None, "auto", state, "server")  # the server's slice H_s, as without the factors
    rows.append(baseline)
    for rank in sorted(args.ranks):
        cut = {c: TaskVector({k: t[:rank] for k, t in f.items()}) for c, f in full.items()}
        with_factors = GlobalState(state.round, {**state.vectors, **{curvature_name(c): f for c, f in cut.items()}},
                                   {**state.scalars, "curvature_rank": rank})
        lowest = {str(c): float(sum((t[rank - 1] ** 2).sum() for t in f.values())) for c, f in cut.items()}
        for form in FORMS:
            rows.append({**remove(rank, form, with_factors, "clients"), "kth_eigenvalue": lowest})
        auto = rows[-len(FORMS)]
        print(f"RATIO rank{rank} clients/server removal time = {auto['seconds'] / baseline['seconds']:.3f} "
              f"(auto form; {auto['seconds']:.2f} s / {baseline['seconds']:.2f} s)")
    ta, bsr = ([100 * r[key] for r in retrainings] for key in ("ta", "bsr"))
    spread = ("" if len(retrainings) < 2 else f"; it and {len(others)} retrainings in other training orders "
              f"(`retrained_order*`) span TA {min(ta):.1f}-{max(ta):.1f}, BSR {min(bsr):.1f}-{max(bsr):.1f}, a range "
              f"widened by the goal's window ({GOAL_TA:g} and {GOAL_BSR:g} points) in the table")
    lines = [f"**F²L² removal of client {target} with the server's Hessian H_s and with the retained clients' rank-k "
             f"curvature factors ({args.folder}; retrained: TA {100 * reference['accuracy']:.1f}, BSR "
             f"{100 * reference[BSR]:.1f}{spread})**", "",
             "| Hessian | form asked | form taken | TA % | BSR % | ΔTA | ΔBSR | inside retraining's range "
             "| ‖step‖ / radius | λ | k-th eigenvalue (retained clients) | removal s |", "|---" * 12 + "|"]
    for r in rows:
        source = "H_s (server)" if r["rank"] is None else f"clients, rank {r['rank']}"
        kth = ", ".join(f"{v:.3g}" for v in r.get("kth_eigenvalue", {}).values()) or "-"
        lines.append(f"| {source} | {r['gradient']} | {r['form']} | {100 * r['ta']:.1f} | {100 * r['bsr']:.1f} "
                     f"| {r['delta_ta']:+.1f} | {r['delta_bsr']:+.1f} "
                     f"| {'-' if r['inside_spread'] is None else ('yes' if r['inside_spread'] else 'no')} "
                     f"| {r['step']:.3g} / {r['trust_radius']:.3g} "
                     f"| {r['lambda']:.3g} | {kth} | {r['seconds']:.1f} |")
    text = "\n".join(lines) + "\n"
    write_atomic(args.folder / "curvature_rank.md", text)
    write_atomic(args.folder / "curvature_rank.json", json.dumps(rows, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
