"""F²L²'s removal with the server's stored factor of H_s (λ_max read from it, preconditioned CG) against the
same removal without it (Lanczos for λ_max, plain CG), on one finished run, in the same process.

    python benchmarks/f2l2_preconditioner.py runs/f2l2_mlp_seeds/seed_0/trained
    python benchmarks/f2l2_preconditioner.py --quick     # its own small digits run (3 clients, 3 rounds)

The run is an F²L² training run (`recipes/f2l2_backdoor.py` writes them under `<output_dir>/trained`). A run
trained before `server_curvature_rank` existed has no factor: it is formed here as the gradient round would
form it, and that time is reported. Each repeat removes the run's backdoored client (or client 0) twice, in
alternating order: with the factor and with the state stripped of it, in the given gradient forms. Prints per
form the median times, CG iterations, the distance between the two removed models over the step's length,
and `RATIO <form> plain/preconditioned removal time = x`; where the run sits in a recipe folder beside its
`retrained` run, each removal's time over that retraining's training rounds (as the recipe's table measures
it); and, where it formed the factor, its one-off cost against a training round and the run's training rounds.
"""

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from f2l2_curvature_rank import QUICK  # noqa: E402  (its small digits protocol; this folder is on sys.path)

from hf_fedtask.config import RunConfig  # noqa: E402
from hf_fedtask.core.state import SERVER_CURVATURE  # noqa: E402
from hf_fedtask.engine.run import run  # noqa: E402
from hf_fedtask.engine.run_folder import open_finished_run  # noqa: E402
from hf_fedtask.strategies.base import task_model  # noqa: E402
from hf_fedtask.strategies.f2l2 import RemovalOptions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="?", help="a finished F²L² training run")
    parser.add_argument("--forms", nargs="+", default=["auto", "retained", "difference"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="without a run: a small digits run of its own")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.run_dir is None and not args.quick:
        parser.error("give a finished F²L² run folder (or --quick)")
    if args.run_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            args.run_dir = Path(tmp) / "trained"
            run(RunConfig(**QUICK, output_dir=str(args.run_dir)))
            args.repeats = min(args.repeats, 2)
            measure(args)
    else:
        measure(args)


def measure(args) -> None:
    finished = open_finished_run(args.run_dir)
    env, state = finished.env, finished.state
    strategy, task = env.strategy, env.tasks[0].name
    client = max(env.config.backdoor_client, 0)
    rounds = [r["seconds"] for r in finished.history if r.get("kind", "train") == "train"]
    sibling = args.run_dir.parent / "retrained"
    retrain_s = (sum(r["seconds"] for r in open_finished_run(sibling).history if r.get("kind", "train") == "train")
                 if (sibling / "checkpoint.safetensors").exists() and sibling != args.run_dir else None)
    if SERVER_CURVATURE in state.vectors:
        formed = None
    else:  # a run from before server_curvature_rank: form the factor as its gradient round would
        start = time.perf_counter()
        state = strategy.factor_server_hessian(state, env)
        formed = time.perf_counter() - start
        if SERVER_CURVATURE not in state.vectors:
            raise SystemExit(f"{args.run_dir}: server_curvature_rank is 0 in this run's options; nothing to compare")
    bare = dataclasses.replace(state, vectors={k: v for k, v in state.vectors.items() if k != SERVER_CURVATURE})
    rank = state.scalars["server_curvature_rank"]
    w = task_model(state.vectors, task)
    print(f"{args.run_dir}: {task}, {sum(t.numel() for t in w.values())} trainable parameters, the server's factor "
          f"of H_s has rank {rank}; {torch.get_num_threads()} threads")
    for form in args.forms:
        times = {"plain": [], "preconditioned": []}
        for repeat in range(args.repeats):
            order = ("plain", "preconditioned") if repeat % 2 == 0 else ("preconditioned", "plain")
            for name in order:
                start = time.perf_counter()
                removal = strategy.remove_client(state if name == "preconditioned" else bare, env, client,
                                                 RemovalOptions(gradient=form, hessian="server"))
                times[name].append(time.perf_counter() - start)
                if name == "plain":
                    plain = removal
                else:
                    fast = removal
        w_plain, w_fast = task_model(plain.state.vectors, task), task_model(fast.state.vectors, task)
        gap = float((w_plain - w_fast).norm() / max((w_plain - w).norm(), 1e-30))
        slow_s, fast_s = statistics.median(times["plain"]), statistics.median(times["preconditioned"])
        print(f"{form}: plain {slow_s:.3f} s ({plain.eigen_iterations} Lanczos products, {plain.solves} solve(s), "
              f"last {plain.cg_iterations} CG iterations; form {plain.form}, λ {plain.l2:.4g}); preconditioned "
              f"{fast_s:.3f} s (last {fast.cg_iterations} CG iterations; form {fast.form}, λ {fast.l2:.4g}); "
              f"‖w_plain − w_preconditioned‖ / ‖step‖ = {gap:.1e}")
        print(f"RATIO {form} plain/preconditioned removal time = {slow_s / fast_s:.2f} "
              f"(median of {args.repeats}; {slow_s:.3f} s / {fast_s:.3f} s)")
        if retrain_s:
            print(f"{form}: removal time / retraining's training rounds ({retrain_s:.1f} s, {sibling}): plain "
                  f"{slow_s / retrain_s:.4f}, preconditioned {fast_s / retrain_s:.4f}")
    if formed is not None and rounds:
        print(f"the factor, formed here as the gradient round would: {formed:.2f} s = "
              f"{formed / statistics.median(rounds):.2f} training rounds (median {statistics.median(rounds):.2f} s), "
              f"{formed / sum(rounds):.3f} of the run's {len(rounds)} training rounds ({sum(rounds):.1f} s)")


if __name__ == "__main__":
    main()
