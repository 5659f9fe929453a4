"""The statistics behind "What we found" on MaTU in docs/results/matu.md (builtin-8, MiniLM + LoRA r=8):

1. Independent task vectors: each task trained alone for one epoch from the same seeded init θ_p;
   their pairwise sign agreement and the share of each task's entries a 4-task unification keeps
   (its mask density).
2. MaTU runs of the multi-task table's setting (30 clients, ξ=0.2, ζ=0.5, 15 rounds), stepped round
   by round: the mean norm of the server's task vectors τ^t, the pairwise sign agreement among them,
   the density of the all-task unification's masks and the mean test accuracy, for the combine rule
   of Eq. 7 (s_normalized, mean, sum) and κ ∈ {2, 0}.

    python benchmarks/matu_findings.py                 # about 35 min on 2 cores
    python benchmarks/matu_findings.py --quick         # a smoke run: 2 tasks, 3 rounds, tiny data

Writes `<output-dir>/matu_findings.json` and prints (and writes) `matu_findings.md`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hf_fedtask.config import RunConfig  # noqa: E402
from hf_fedtask.core.state import MATU_EXPORT, matu_task_vector_name  # noqa: E402
from hf_fedtask.core.taskvector import TaskVector  # noqa: E402
from hf_fedtask.engine.inprocess import Federation  # noqa: E402
from hf_fedtask.merge.bitmask import unpack_bits  # noqa: E402
from hf_fedtask.merge.unify import unify  # noqa: E402

VARIANTS = {  # name -> MaTU options
    "s_normalized, κ=2": {"combine": "s_normalized", "kappa": 2},
    "s_normalized, κ=0": {"combine": "s_normalized", "kappa": 0},
    "mean, κ=2": {"combine": "mean", "kappa": 2},
    "sum, κ=2": {"combine": "sum", "kappa": 2},
}


def sign_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of entries where both vectors are non-zero and have the same sign (among those non-zero in both)."""
    both = (a != 0) & (b != 0)
    return float(((a.sign() == b.sign()) & both).sum() / both.sum().clamp(min=1))


def mean_pairwise_agreement(vectors: list[torch.Tensor]) -> float:
    return float(np.mean([sign_agreement(a, b) for a, b in itertools.combinations(vectors, 2)]))


def independent_vectors(config: RunConfig) -> dict:
    """Each task trained alone for one epoch from θ_p and its initial head; sign agreement and unification."""
    fed = Federation(config)
    env, origin = fed.env, fed.origin
    flats = {}
    for task in fed.tasks:
        data = env.host.tokenize(task.dataset["train"], task)
        start = TaskVector({**origin, **env.initial_heads[task.name]})
        trained, _ = env.trainer.train(start, data, seed=config.seed)
        flats[task.name] = (trained.filter(lambda k: k in origin) - origin).flatten()
    names = sorted(flats)
    densities = []
    for group in (names[:4], names[4:8]):
        if len(group) < 2:
            continue
        u = unify([TaskVector({"v": flats[t]}) for t in group])
        numel = flats[group[0]].numel()
        densities += [float(unpack_bits(m, numel).float().mean()) for m in u.masks]
    return {"tasks": names, "sign_agreement": mean_pairwise_agreement([flats[t] for t in names]),
            "unify4_mask_density": [min(densities), max(densities)] if densities else None}


def matu_trajectory(config: RunConfig, desc: str) -> list[dict]:
    """Per round: mean ‖τ^t‖, pairwise sign agreement of the τ^t, export-mask density, mean accuracy."""
    fed = Federation(config)
    state = fed.initial_state()
    tasks = [t.name for t in fed.tasks]
    rows = []
    for r in range(1, config.rounds + 1):
        start = time.perf_counter()
        state, record = fed.run_round(state, r)
        vectors = [state.vectors[matu_task_vector_name(t)].flatten() for t in tasks]
        masks = state.vectors[MATU_EXPORT]["masks"]
        numel = vectors[0].numel()
        rows.append({
            "round": r,
            "mean_accuracy": record["mean_metric"],
            "mean_task_vector_norm": float(np.mean([float(v.norm()) for v in vectors])),
            "sign_agreement": mean_pairwise_agreement(vectors),
            "mask_density": float(np.mean([float(unpack_bits(m, numel).float().mean()) for m in masks])),
        })
        print(f"  {desc} round {r}: acc {rows[-1]['mean_accuracy']:.4f}  norm {rows[-1]['mean_task_vector_norm']:.3g}  "
              f"agree {rows[-1]['sign_agreement']:.3f}  mask {rows[-1]['mask_density']:.3f}  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def table(found: dict) -> str:
    ind = found["independent"]
    lines = ["**Independent one-epoch task vectors** (from the same init θ_p)", "",
             f"- pairwise sign agreement: {100 * ind['sign_agreement']:.1f}%"]
    if ind["unify4_mask_density"]:
        lo, hi = ind["unify4_mask_density"]
        lines.append(f"- a 4-task unification keeps {100 * lo:.1f}–{100 * hi:.1f}% of each task's entries")
    rounds = found["rounds"]
    check = sorted({min(6, rounds), rounds})
    lines += ["", "**MaTU on the multi-task setting** (ζ=0.5), by Eq. 7's combine rule and κ", "",
              "| variant | " + " | ".join(f"acc % r{r} | ‖τ^t‖ r{r}" for r in check)
              + " | sign agreement | mask density |",
              "|---|" + "---|---|" * len(check) + "---|---|"]
    for name, rows in found["matu"].items():
        by_round = {row["round"]: row for row in rows}
        cells = [f"{100 * by_round[r]['mean_accuracy']:.1f} | {by_round[r]['mean_task_vector_norm']:.3g}"
                 for r in check]
        last = rows[-1]
        lines.append(f"| {name} | " + " | ".join(cells) +
                     f" | {100 * last['sign_agreement']:.1f}% | {100 * last['mask_density']:.1f}% |")
    lines += ["", f"(sign agreement and mask density of the server's task vectors after round {rounds})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/matu_findings")
    parser.add_argument("--quick", action="store_true", help="2 tasks, 3 rounds, 64 samples per task")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="matu_findings_") if args.quick else args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = dict(suite="builtin-8", num_clients=30, participation=0.2, rounds=15, zeta=0.5, local_epochs=1.0,
                output_dir=str(out))
    if args.quick:
        base.update(tasks=["vader_polarity", "kaomoji_emotion"], suite=None, num_clients=4, participation=0.5, rounds=3,
                    max_train_samples=64)
    start = time.perf_counter()
    found = {"setting": base, "rounds": base["rounds"]}
    print("independent task vectors ...", flush=True)
    found["independent"] = independent_vectors(RunConfig(**{**base, "strategy": "fedavg"}))
    found["matu"] = {}
    for name in args.variants:
        print(f"MaTU {name} ...", flush=True)
        config = RunConfig(**{**base, "strategy": "matu", "strategy_options": VARIANTS[name]})
        found["matu"][name] = matu_trajectory(config, name)
    found["seconds"] = round(time.perf_counter() - start, 1)
    (out / "matu_findings.json").write_text(json.dumps(found, indent=1))
    text = table(found)
    (out / "matu_findings.md").write_text(text)
    print(text)
    print(f"wall time {found['seconds']:.0f} s; written to {out / 'matu_findings.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
