"""The main job (`recipes/matu_30task.py`: MaTU, builtin-30, 30 clients, 6 a round, MiniLM + LoRA r=8) with the
Trainer loop and with the lean loop, round by round in the same process: what the lean loop saves of the main
job's wall time, and that it changes no result.

Two federations of the recipe's configuration (`client_loop: trainer` and `client_loop: lean`) run the same
rounds alternately (trainer, lean, trainer, ...) after one untimed warm-up round each; a round's seconds
include the server's aggregation (and its evaluation, on the recipe's `eval_every` rounds). At the end every
tensor of the two states is compared: the lean loop takes the Trainer's steps bit for bit, so the accuracy is
the same. The ratio is lean/trainer of the summed round times; the box load is printed beside it.

    python benchmarks/main_job_loops.py --quick        # 2 timed rounds, 2 clients a round
    python benchmarks/main_job_loops.py --rounds 6     # 6 timed rounds of the main job's configuration
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))


def load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 timed rounds of 2 clients (participation 2/30)")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per loop (6)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    args = p.parse_args()
    from matu_30task import DEFAULTS

    from hf_fedtask.config import RunConfig
    from hf_fedtask.engine.inprocess import Federation

    torch.set_num_threads(args.threads)
    values = {**DEFAULTS, "output_dir": "/tmp/hf_fedtask_main_job_loops"}
    if args.quick:
        args.rounds, values["participation"] = 2, 2 / 30
    base = RunConfig.from_dict(values)
    feds = {loop: Federation(dataclasses.replace(base, client_loop=loop)) for loop in ("trainer", "lean")}
    states = {loop: fed.initial_state() for loop, fed in feds.items()}
    seconds = {loop: [] for loop in feds}
    print(f"start: {load()}; torch threads {args.threads}; {args.rounds} timed rounds per loop")
    for r in range(1, args.rounds + 2):
        for loop, fed in feds.items():
            t0 = time.perf_counter()
            states[loop], _ = fed.run_round(states[loop], r)
            if r > 1:  # round 1 is the warm-up
                seconds[loop].append(time.perf_counter() - t0)
    a, b = states["trainer"].vectors, states["lean"].vectors
    equal = a.keys() == b.keys() and all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])
    for loop, ts in seconds.items():
        print(f"{loop}: rounds [s] " + " ".join(f"{t:.2f}" for t in ts) + f"; total {sum(ts):.2f}")
    print(f"states after {args.rounds + 1} rounds equal tensor for tensor: {equal}")
    ratio = sum(seconds["lean"]) / sum(seconds["trainer"])
    print(f"RATIO main job lean/trainer seconds per round = {ratio:.3f} ({load()})")
    if not equal:
        raise SystemExit("the lean loop's state differs from the Trainer's")


if __name__ == "__main__":
    main()
