"""F²L²'s removal with the retained clients' own Hessian from rank-k curvature factors, against the rank.

    python benchmarks/f2l2_curvature_rank.py runs/f2l2_text_3200 --ranks 64 128 256 512

Takes a finished `recipes/f2l2_backdoor.py` output folder (its `trained` and `retrained` runs, trained without
`curvature_rank`), computes each client's factor as the run's gradient round would have with `curvature_rank`
= max(ranks) (`hf_fedtask.model.newton.curvature_factor` over the client's own data at w₀; cached in
`<folder>/curvature_factors_<k>/`), keeps the top k rows for each k, and removes the backdoored client with
those factors (`hessian` clients) in the auto, retained and split forms. Writes `<folder>/curvature_rank.md`
and `.json`: TA and BSR of each removal, their gaps to retraining, the form taken, ‖step‖ against the trust
radius, and each client's k-th eigenvalue against the damping λ. What it saves over a rerun of the recipe:
training the run again (the factors do not change training, only the last round's upload).
"""

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from hf_fedtask.core.files import write_atomic  # noqa: E402
from hf_fedtask.core.state import GlobalState, curvature_name  # noqa: E402
from hf_fedtask.core.taskvector import TaskVector  # noqa: E402
from hf_fedtask.data.backdoor import METRIC as BSR  # noqa: E402
from hf_fedtask.engine.run_folder import open_finished_run  # noqa: E402
from hf_fedtask.engine.server import Server  # noqa: E402
from hf_fedtask.model.newton import curvature_factor, hessian  # noqa: E402
from hf_fedtask.strategies.base import task_model, task_point  # noqa: E402
from hf_fedtask.strategies.f2l2 import FACTOR_JACOBIAN_BYTES, RemovalOptions  # noqa: E402

FORMS = ("auto", "retained", "split")


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
        with hessian(env.host, point, data, max_bytes=FACTOR_JACOBIAN_BYTES) as products:
            out[client] = curvature_factor(products, model, rank, seed=client)
        print(f"client {client}: rank-{rank} factor in {time.perf_counter() - start:.1f} s", flush=True)
        cache.mkdir(parents=True, exist_ok=True)
        out[client].save(path)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a finished recipes/f2l2_backdoor.py output folder")
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    trained, retrained = open_finished_run(args.folder / "trained"), open_finished_run(args.folder / "retrained")
    env, state = trained.env, trained.state
    task, target = env.tasks[0].name, env.config.backdoor_client
    reference = Server(retrained.env).evaluate(retrained.state)[task]
    top = max(args.ranks)
    retained = [c for c in range(env.num_clients) if c != target]  # the removal reads theirs alone
    full = factors(env, state, task, top, args.folder / f"curvature_factors_{top}", retained)
    rows = []
    for rank in sorted(args.ranks):
        cut = {c: TaskVector({k: t[:rank] for k, t in f.items()}) for c, f in full.items()}
        with_factors = GlobalState(state.round, {**state.vectors, **{curvature_name(c): f for c, f in cut.items()}},
                                   {**state.scalars, "curvature_rank": rank})
        lowest = {c: float(sum((t[rank - 1] ** 2).sum() for t in f.values())) for c, f in cut.items()}
        for form in FORMS:
            start = time.perf_counter()
            removal = env.strategy.remove_client(with_factors, env, target, RemovalOptions(gradient=form))
            seconds = time.perf_counter() - start
            evals = Server(env).evaluate(removal.state)[task]
            rows.append({"rank": rank, "gradient": form, "form": removal.form, "hessian": removal.hessian,
                         "ta": evals["accuracy"], "bsr": evals[BSR],
                         "delta_ta": 100 * (evals["accuracy"] - reference["accuracy"]),
                         "delta_bsr": 100 * (evals[BSR] - reference[BSR]), "lambda": removal.l2,
                         "step": removal.step_norm, "trust_radius": removal.trust_radius, "seconds": seconds,
                         "kth_eigenvalue": {str(c): v for c, v in lowest.items()}})
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"**F²L² removal of client {target} with the retained clients' rank-k curvature factors "
             f"({args.folder}; retrained: TA {100 * reference['accuracy']:.1f}, BSR {100 * reference[BSR]:.1f})**", "",
             "| rank k | form asked | form taken | TA % | BSR % | ΔTA | ΔBSR | ‖step‖ / radius | λ | k-th eigenvalue "
             "(retained clients) | removal s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kth = ", ".join(f"{v:.3g}" for v in r["kth_eigenvalue"].values())
        lines.append(f"| {r['rank']} | {r['gradient']} | {r['form']} | {100 * r['ta']:.1f} | {100 * r['bsr']:.1f} "
                     f"| {r['delta_ta']:+.1f} | {r['delta_bsr']:+.1f} | {r['step']:.3g} / {r['trust_radius']:.3g} "
                     f"| {r['lambda']:.3g} | {kth} | {r['seconds']:.1f} |")
    text = "\n".join(lines) + "\n"
    write_atomic(args.folder / "curvature_rank.md", text)
    write_atomic(args.folder / "curvature_rank.json", json.dumps(rows, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
