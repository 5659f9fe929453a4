"""F²L²'s removal with the clients' curvature factors: with the Gram the server keeps from when they arrived,
against forming it at removal time (the block products between the retained clients' factors).

    python benchmarks/f2l2_kept_gram.py runs/f2l2_text_3200_cg_precond --repeats 3
    python benchmarks/f2l2_kept_gram.py --quick    # its own small digits protocol (cg, rank-8 factors)

Takes a finished `recipes/f2l2_backdoor.py` folder trained with `curvature_rank` > 0, and times the default
removal of client 0 (no client contacted) `--repeats` times each way on the trained run's final state: as
kept (a run made before the server kept the Gram gets it here, formed by `F2L2.factor_gram` as the server now
does when the factors arrive), and with the Gram dropped. Prints a `RATIO` line (with / without, the median
over repeats), each removal's time against the retraining's training rounds (`retrained/metrics.jsonl`), and
the distance between the two removals' models (the same step: only where the Gram comes from differs).
"""

import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from f2l2_curvature_rank import QUICK, folder_parser, on_folder  # noqa: E402  (this folder is on sys.path)

from hf_fedtask.config import RunConfig  # noqa: E402
from hf_fedtask.core.state import CURVATURE_GRAM, GlobalState, curvature_name  # noqa: E402
from hf_fedtask.engine.run import run  # noqa: E402
from hf_fedtask.engine.run_folder import open_finished_run  # noqa: E402
from hf_fedtask.strategies.base import task_model  # noqa: E402

LOCAL = ("local_epochs", "learning_rate", "lr_scheduler")  # the digits protocol's local optimizer, which cg refuses
QUICK_CG = {**{k: v for k, v in QUICK.items() if k not in LOCAL},
            "strategy_options": {**QUICK["strategy_options"], "l2": 0.01, "linear_solver": "cg", "curvature_rank": 8}}


def quick_protocol(folder: Path) -> None:
    """The small digits protocol under linear_solver cg with rank-8 factors: `trained`, and `retrained` without
    client 0."""
    run(RunConfig(**QUICK_CG, output_dir=str(folder / "trained")))
    run(RunConfig(**QUICK_CG, exclude_clients=[0], output_dir=str(folder / "retrained")))


def main() -> None:
    parser = folder_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="without a folder: a small digits protocol of its own in a temporary folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--client", type=int, default=0)
    args = parser.parse_args()
    on_folder(parser, args, measure, protocol=quick_protocol)


def measure(args) -> None:
    """Times the removal both ways on `args.folder` and prints the lines the module docstring names."""
    finished = open_finished_run(args.folder / "trained")
    state, env = finished.state, finished.env
    if not state.scalars.get("curvature_rank"):
        raise SystemExit(f"{args.folder}: trained without curvature_rank; there are no client factors to time")
    strategy = env.strategy
    clients = strategy.factor_clients(state.scalars)
    if CURVATURE_GRAM in state.vectors:
        kept = state
    else:
        start = time.perf_counter()
        gram = strategy.factor_gram([state.vectors[curvature_name(int(c))] for c in clients])
        print(f"forming the Gram (the server does it once, when the factors arrive): "
              f"{time.perf_counter() - start:.2f} s")
        kept = GlobalState(state.round, {**state.vectors, CURVATURE_GRAM: gram},
                           {**state.scalars, "factor_clients": clients, "factor_gram": True})
    dropped = GlobalState(state.round, {k: v for k, v in state.vectors.items() if k != CURVATURE_GRAM},
                          {**state.scalars, "factor_gram": False})
    history = [json.loads(line) for line in (args.folder / "retrained" / "metrics.jsonl").read_text().splitlines()]
    retraining = sum(record["seconds"] for record in history[:-1])
    medians, models = {}, {}
    for name, s in (("kept Gram", kept), ("Gram formed at removal", dropped)):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = strategy.remove_client(s, env, args.client)
            times.append(time.perf_counter() - start)
        medians[name], models[name] = statistics.median(times), task_model(result.state.vectors, env.tasks[0].name)
        print(f"{name}: form {result.form}, Hessian {result.hessian}, damping {result.damping}; removal "
              f"{', '.join(f'{t:.2f}' for t in times)} s = {', '.join(f'{t / retraining:.4f}' for t in times)} of "
              f"retraining's {retraining:.1f} s")
    a, b = models.values()
    print(f"‖w_kept − w_formed‖ = {float((a - b).norm()):.2e} (step {result.step_norm:.3f})")
    print(f"RATIO kept Gram / formed at removal: {medians['kept Gram'] / medians['Gram formed at removal']:.2f}")


if __name__ == "__main__":
    main()
