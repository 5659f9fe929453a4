"""The MaTU paper's Tables 1 and 2 on builtin-8: single-task clients (ζ_t = 0) and multi-task clients
(ζ_t = 0.5), for MaTU and its baselines, against individual centralized LoRA.

    python recipes/matu_8task.py                        # builtin-8, MiniLM + LoRA r=8, CPU
    python recipes/matu_8task.py --rounds 40            # any RunConfig key is a flag
    python recipes/matu_8task.py --preset paper         # ViT-B/32 + LoRA r=16, TA8 (GPU + network)
    python recipes/matu_8task.py --strategies matu fedavg

30 clients, a seeded 20% of them per round, one local epoch per task (the paper's protocol, with
fewer rounds). Writes `<output_dir>/comparison.md` (the tables), `comparison.json`,
`comparison.png`, and every run under `<output_dir>/<setting>/<strategy>/`. Rerunning resumes.
"""

import os
import sys

if "--preset" not in sys.argv:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from hf_fedtask.errors import FedTaskError
from hf_fedtask.workflows.compare import run_comparison, write_comparison
from hf_fedtask.workflows.recipe import presets_beside, recipe_config, recipe_parser

DEFAULTS = {
    "suite": "builtin-8",
    "num_clients": 30,
    "participation": 0.2,
    "rounds": 15,
    "local_epochs": 1.0,
    "export": False,
    "output_dir": "runs/matu8",
}
STRATEGIES = ["matu", "fedavg", "fedprox", "fedper", "matfl"]
SETTINGS = {"single_task": {"zeta": 0.0}, "multi_task": {"zeta": 0.5}}
TITLES = {"single_task": "Single-task clients (ζ_t = 0), test accuracy %",
          "multi_task": "Multi-task clients (ζ_t = 0.5), test accuracy %"}


def main(argv=None) -> int:
    presets = presets_beside(__file__, paper="matu_vit_b32_8task.yaml")
    parser = recipe_parser(__doc__.splitlines()[0], presets)
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES)
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    args = parser.parse_args(argv)
    try:
        base = recipe_config(args, DEFAULTS, presets)
        table = run_comparison(base, args.strategies, {s: SETTINGS[s] for s in args.settings})
        path = write_comparison(table, base, TITLES)
    except FedTaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path.read_text())
    print(f"tables: {path}  (and {path.with_suffix('.json')}, {path.with_suffix('.png')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
