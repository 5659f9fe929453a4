"""The main job: MaTU on the 30-task builtin suite, offline, on a CPU, in under 10 minutes.

    accelerate launch recipes/matu_30task.py                 # builtin-30, MiniLM + LoRA r=8
    accelerate launch recipes/matu_30task.py --preset paper  # ViT-B/32 + LoRA r=16 on the 30 EMR
                                                             # vision datasets (GPU + network)

30 clients hold the 30 tasks through a Dirichlet task allocation (ζ_t = 0.2: most clients hold
several tasks, each task is split over its holders); each round a seeded 20% of the clients train one
local epoch per task they hold, for 24 rounds (7 min 31 s measured on 2 cores with `accelerate launch`
when this default was set; docs/results/matu.md gives the latest). Every task's test split is evaluated
after every 4th round (an evaluation costs about two thirds of a training round here; `--eval-every 1`
evaluates every round). The recipe uses every core it may (`accelerate launch` alone gives it one
thread); `--threads N` or your OMP_NUM_THREADS wins. The paper runs 300 rounds with every client each
round; this default is the same algorithm scaled to the CPU budget, with one change: the downlink carries
each held task's own τ^t, so a client's step is measured where the server adds it, in 4-bit integers with
server-side error feedback (`downlink: per_task_int4`): 0.82x the downlink bytes of the paper's unified
downlink (`--downlink unified`, which the paper preset keeps) and 0.15x those of float32 vectors
(`--downlink per_task`), at the accuracy of the latter (the README and docs/results/matu.md have all three,
and Eq. 7's rules). Any RunConfig key is a flag (`--rounds 50`);
`--results-page docs/results/matu.md` also writes the table into that page.

At the end: a per-task table (accuracy and accuracy normalized by individual centralized LoRA),
`accuracy_vs_round.png`, `results.json`, one stock PEFT adapter per task under `adapters/`, the
compact export (θ_p regenerated from the seed, one float16 unified vector, 1-bit masks, rescalers: 0.068x
the bytes of the 30 adapters) under `compact/`, and the command that
pushes an adapter to the Hub.
"""

import os
import sys

if "--preset" not in sys.argv:  # the default job needs no network (the paper preset downloads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from hf_fedtask.workflows.recipe import presets_beside, run_recipe

DEFAULTS = {
    "strategy": "matu",
    "suite": "builtin-30",
    "num_clients": 30,
    "zeta": 0.2,
    "participation": 0.2,
    "rounds": 24,  # what fits the 10-minute budget on 2 cores (see the docstring)
    "eval_every": 4,  # 6 evaluations instead of 24 pay for 7 more rounds than the previous default of 17
    "local_epochs": 1.0,
    "downlink": "per_task_int4",  # each task from its own τ^t in 4-bit integers; --downlink unified: the paper's
    "output_dir": "runs/matu30",
}


def main(argv=None) -> int:
    presets = presets_beside(__file__, paper="matu_vit_b32.yaml")
    return run_recipe(__doc__.splitlines()[0], DEFAULTS, presets, argv, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
