"""Where MaTU's client step lands, on a quadratic many-task toy driven through the real strategy.

Under the `delta` reading a client trains task t from the start the downlink gives it and uploads the
change; the server adds the aggregated change to its stored τ^t. With `downlink: unified` (the paper's)
the start is λ_t·(m_t ⊙ τ), decoded from the unification of the client's tasks, which is not τ^t where
tasks disagree: the step is measured at one point and added at another. This script measures what that
costs and what the two ways to make the points agree give:

    unified           the default: step measured at the decoded start, added to the stored τ^t
    land at start     no extra bytes: the server re-decodes what it sent each holder and adds the
                      step there (τ^t ← Σ_n γ_n·start_n^t + combine(...)); not adopted, see below
    per-task downlink `downlink: per_task`: the downlink carries each held task's τ^t

References: FedAvg (one vector for all tasks) and per-task FedAvg (each task its own vector,
averaged over its holders; the same client training, no unification anywhere).

The toy: 8 tasks whose optima τ*_t mix 3 shared random directions with their own part (so tasks
agree, oppose or are unrelated entry by entry), 16 clients holding 1-3 tasks each with their own
noisy optimum θ_p + τ*_t + noise, half the clients per round, 15 rounds; local training is K gradient
steps of size η on ½‖θ − θ*‖², whose endpoint moves by c = (1 − η)^K per unit of start. Score: the
share of the attainable loss reduction, 1 − ‖τ^t − r_t‖² / ‖r_t‖² (r_t: the holders' sample-weighted
mean optimum), averaged over tasks; 1 is the best any method can do. Bytes per round: both
directions, from the safetensors bytes the engines send.

    python benchmarks/matu_start.py            # 3 seeds x 2 local-training regimes, about 15 s
    python benchmarks/matu_start.py --quick    # 1 seed, 5 rounds

Measured (3 seeds, mean ± std):

| method | 5 steps, η=0.2 (c=0.33) | 1 step, η=0.1 (c=0.9) | kB/round |
|---|---|---|---|
| MaTU, unified downlink (default) | 0.834 ± 0.032 | 0.685 ± 0.052 | 45.7 |
| MaTU, step landed at the decoded start | 0.732 ± 0.009 | 0.358 ± 0.082 | 45.7 |
| MaTU, per-task downlink (`downlink: per_task`) | 0.956 ± 0.009 | 0.664 ± 0.050 | 58.8 |
| MaTU, per-task downlink in 4 bits (`downlink: per_task_int4`) | 0.953 ± 0.009 | 0.662 ± 0.051 | 32.5 |
| MaTU, per-task downlink, 4 bits, no error feedback | 0.952 ± 0.010 | 0.661 ± 0.051 | 32.5 |
| MaTU, per-task downlink, 4 bits, `combine: s_normalized_cross` | 0.933 ± 0.017 | 0.887 ± 0.027 | 32.5 |
| MaTU, per-task downlink, `combine: sum` | 0.900 ± 0.019 | 0.834 ± 0.035 | 58.8 |
| FedAvg | 0.014 ± 0.113 | 0.099 ± 0.082 | 43.6 |
| per-task FedAvg | 0.978 ± 0.007 | 0.913 ± 0.019 | 71.2 |

Landing at the decoded start cannot be the fix: local training moves each entry only part of the way
from where it starts (c > 0), so whatever the unification drops from τ^t is dropped again every round,
and the shorter the local run the less is recovered. The per-task downlink closes most of the gap to
per-task FedAvg when local training goes far (0.956 against 0.834 and 0.978) for 1.29x the bytes here
in float32 (clients hold 1-3 tasks; the ratio grows with the tasks a client holds); in 4-bit integers it
scores the same (0.953, 0.662) for 0.71x the unified downlink's bytes (error feedback changes nothing
measurable at 4 bits). With one short step per round the per-task downlink changes nothing (0.664 against
0.685): there what separates MaTU from per-task FedAvg is the pace of Eq. 7, whose `s_normalized` rule
divides a task's step by 1 + Σ S; `s_normalized_cross`, which keeps the task's own step whole, lifts
that regime from 0.662 to 0.887 (per-task FedAvg: 0.913) and costs 0.020 with long local runs; the
literal `sum` (the neighbours' steps added at full similarity weight) gains less (0.834) and loses more
(0.900).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from types import SimpleNamespace

import numpy as np
import torch

from hf_fedtask.core.state import SHARED, head_name, matu_task_vector_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, pack_vectors
from hf_fedtask.strategies import build_strategy
from hf_fedtask.strategies.base import ClientJob, updates_by_task
from hf_fedtask.strategies.matu import MaTU, decode_task, encode_wire

SHAPES = {"q.lora_A.weight": (8, 32), "q.lora_B.weight": (32, 8)}
HEAD = {"classifier.weight": (2, 4)}
REGIMES = {"5 steps, η=0.2": (5, 0.2), "1 step, η=0.1": (1, 0.1)}
HEADER = dict(base_model="toy", base_model_revision="0", peft_config_hash="0")


class ToyHost:
    """The two things a strategy asks a host for: θ_p (seeded) and a zero head per task."""

    def initial_shared(self) -> TaskVector:
        gen = torch.Generator().manual_seed(0)
        return TaskVector({k: torch.randn(s, generator=gen) for k, s in SHAPES.items()})

    def initial_head(self, num_labels: int, seed: int) -> TaskVector:
        return TaskVector({k: torch.zeros(s) for k, s in HEAD.items()})


class Optimum(list):
    """A client's data for a task: its size (γ_n^t) and the optimum of its loss ½‖θ − θ*‖²."""

    def __init__(self, optimum: TaskVector, size: int):
        super().__init__(range(size))
        self.optimum = optimum


@dataclasses.dataclass
class GradientSteps:
    """Local training: `steps` gradient steps of size `lr` on ½‖θ − θ*‖² over the shared keys."""

    steps: int
    lr: float

    def train(self, start: TaskVector, data: Optimum, seed: int):
        theta = {k: v.clone() for k, v in start.items()}
        for _ in range(self.steps):
            for k, target in data.optimum.items():
                theta[k] -= self.lr * (theta[k] - target)
        return TaskVector(theta), {"train_loss": 0.0}


class MaTULandAtStart(MaTU):
    """MaTU whose server adds each task's step to where its holders started (the decoded downlink,
    recomputed from the state that produced it) instead of to the stored τ^t."""

    def server_aggregate(self, state, updates):
        origin = state.vectors[SHARED]
        starts = {}
        for task, holders in updates_by_task(updates).items():
            total = sum(u.num_samples[task] for u in holders)
            start = origin.zeros_like()
            for u in holders:
                tasks = sorted(u.num_samples)
                sent = encode_wire(self._task_vectors(state, tasks), self.config.rescaler, self.config.wire_dtype)
                start = start + (u.num_samples[task] / total) * decode_task(sent, task, origin)
            starts[matu_task_vector_name(task)] = start
        return super().server_aggregate(dataclasses.replace(state, vectors={**state.vectors, **starts}), updates)


@dataclasses.dataclass
class World:
    origin: TaskVector
    tasks: list[str]
    allocation: dict[int, list[str]]
    optima: dict[tuple[int, str], TaskVector]  # (client, task) -> θ_p + τ*_t + noise
    sizes: dict[int, int]

    def reachable(self) -> dict[str, torch.Tensor]:
        """r_t: the holders' sample-weighted mean optimum, as a flat task vector."""
        out = {}
        for t in self.tasks:
            holders = [c for c, held in self.allocation.items() if t in held]
            total = sum(self.sizes[c] for c in holders)
            out[t] = sum((self.sizes[c] / total) * (self.optima[c, t] - self.origin).flatten() for c in holders)
        return out

    def score(self, vectors: dict[str, torch.Tensor]) -> float:
        reach = self.reachable()
        return float(np.mean([1 - float(((vectors[t] - r) ** 2).sum() / (r ** 2).sum()) for t, r in reach.items()]))


def make_world(seed: int, num_tasks: int = 8, num_clients: int = 16, directions: int = 3, noise: float = 0.5) -> World:
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    origin = ToyHost().initial_shared()
    d = sum(v.numel() for v in origin.values())
    shared = torch.randn(directions, d, generator=gen)
    targets = {f"task{t}": (torch.randn(directions, generator=gen)[:, None] * shared).sum(0) / directions ** 0.5
               + 0.7 * torch.randn(d, generator=gen) for t in range(num_tasks)}
    tasks = sorted(targets)
    allocation = {c: sorted(rng.choice(tasks, size=int(rng.integers(1, 4)), replace=False).tolist())
                  for c in range(num_clients)}
    for t in tasks:  # every task has a holder
        if not any(t in held for held in allocation.values()):
            c = int(rng.integers(num_clients))
            allocation[c] = sorted({*allocation[c], t})
    optima = {(c, t): origin + TaskVector.unflatten(targets[t] + noise * torch.randn(d, generator=gen), origin)
              for c, held in allocation.items() for t in held}
    sizes = {c: 10 + int(rng.integers(0, 20)) for c in allocation}
    return World(origin, tasks, allocation, optima, sizes)


def sampled(world: World, round_: int, seed: int, participation: float = 0.5) -> list[int]:
    rng = np.random.default_rng([seed, round_])
    return sorted(int(c) for c in rng.choice(len(world.allocation), size=int(participation * len(world.allocation)),
                                             replace=False))


def run_strategy(strategy, world: World, trainer, rounds: int, seed: int) -> tuple[float, float]:
    """(score, bytes per round) of `rounds` rounds of a real strategy, its uploads through the wire format."""
    specs = [SimpleNamespace(name=t, num_labels=2) for t in world.tasks]
    state = strategy.init_state(ToyHost(), specs, seed, world.allocation)
    heads = {t: state.vectors[head_name(t)] for t in world.tasks}
    sent = 0
    for r in range(1, rounds + 1):
        updates = []
        for c in sampled(world, r, seed):
            held = world.allocation[c]
            downlink = strategy.downlink(state, c, held)
            job = ClientJob(c, r, {t: Optimum(world.optima[c, t], world.sizes[c]) for t in held}, seed=seed,
                            origin=world.origin, initial_heads=heads)
            blob = strategy.client_update(downlink, job, trainer).to_bytes(**HEADER)
            sent += len(pack_vectors(downlink).to_bytes()) + len(blob)
            updates.append(ClientUpdate.from_bytes(blob, templates=strategy.update_templates(state, c, held),
                                                   expect={}, source=f"client {c}"))
        state = strategy.server_aggregate(state, updates)
    vectors = {t: (strategy.task_parameters(state, t).filter(lambda k: k in world.origin) - world.origin).flatten()
               for t in world.tasks}
    return world.score(vectors), sent / rounds


def run_per_task_fedavg(world: World, trainer, rounds: int, seed: int) -> tuple[float, float]:
    """Each task its own vector, trained from exactly that vector and averaged over its holders (written
    out here: the reference every MaTU variant approximates). Its bytes: each task's vector, each way, as
    one safetensors file (no heads, which the toy never changes)."""
    vectors = {t: world.origin.zeros_like() for t in world.tasks}
    sent = 0
    for r in range(1, rounds + 1):
        steps: dict[str, list[tuple[int, TaskVector]]] = {}
        for c in sampled(world, r, seed):
            for t in world.allocation[c]:
                start = world.origin + vectors[t]
                trained, _ = trainer.train(start, Optimum(world.optima[c, t], 1), seed)
                steps.setdefault(t, []).append((world.sizes[c], trained - start))
                sent += 2 * len(vectors[t].to_bytes())
        for t, got in steps.items():
            total = sum(n for n, _ in got)
            vectors[t] = vectors[t] + sum(((n / total) * s for n, s in got), world.origin.zeros_like())
    return world.score({t: v.flatten() for t, v in vectors.items()}), sent / rounds


METHODS = {
    "MaTU, unified downlink (default)": lambda: build_strategy("matu", {}),
    "MaTU, step landed at the decoded start": lambda: MaTULandAtStart(),
    "MaTU, per-task downlink (`downlink: per_task`)": lambda: build_strategy("matu", {"downlink": "per_task"}),
    "MaTU, per-task downlink in 4 bits (`downlink: per_task_int4`)": lambda: build_strategy(
        "matu", {"downlink": "per_task_int4"}),
    "MaTU, per-task downlink, 4 bits, no error feedback": lambda: build_strategy(
        "matu", {"downlink": "per_task_int4", "downlink_feedback": False}),
    "MaTU, per-task downlink, 4 bits, `combine: s_normalized_cross`": lambda: build_strategy(
        "matu", {"downlink": "per_task_int4", "combine": "s_normalized_cross"}),
    "MaTU, per-task downlink, `combine: sum`": lambda: build_strategy(
        "matu", {"downlink": "per_task", "combine": "sum"}),
    "FedAvg": lambda: build_strategy("fedavg", {}),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 5 rounds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    seeds, rounds = ([0], 5) if args.quick else (args.seeds, args.rounds)
    worlds = {s: make_world(s) for s in seeds}
    rows = {}
    for regime, (steps, lr) in REGIMES.items():
        trainer = GradientSteps(steps, lr)
        for name, make in [*METHODS.items(), ("per-task FedAvg", None)]:
            runs = [run_per_task_fedavg(worlds[s], trainer, rounds, s) if make is None
                    else run_strategy(make(), worlds[s], trainer, rounds, s) for s in seeds]
            scores = [x for x, _ in runs]
            rows.setdefault(name, {})[regime] = (float(np.mean(scores)), float(np.std(scores)))
            rows[name]["bytes"] = float(np.mean([b for _, b in runs]))
            print(f"{regime:>16} | {name:<40} {np.mean(scores):.3f} ± {np.std(scores):.3f}", flush=True)
    lines = [f"| method | {' | '.join(REGIMES)} | kB/round |", "|---|" + "---|" * (len(REGIMES) + 1)]
    for name, cells in rows.items():
        scores = " | ".join(f"{cells[r][0]:.3f} ± {cells[r][1]:.3f}" for r in REGIMES)
        lines.append(f"| {name} | {scores} | {cells['bytes'] / 1e3:.1f} |")
    print(f"\n{len(seeds)} seed(s), {rounds} rounds; score = share of the attainable loss reduction (1 is best)\n")
    print("\n".join(lines))
    unified, exact = rows["MaTU, unified downlink (default)"], rows["MaTU, per-task downlink (`downlink: per_task`)"]
    q4 = rows["MaTU, per-task downlink in 4 bits (`downlink: per_task_int4`)"]
    cross = rows["MaTU, per-task downlink, 4 bits, `combine: s_normalized_cross`"]
    for regime in REGIMES:
        print(f"RATIO per_task/unified score ({regime}) = {exact[regime][0] / unified[regime][0]:.3f}")
        print(f"RATIO per_task 4-bit/per_task score ({regime}) = {q4[regime][0] / exact[regime][0]:.3f}")
        print(f"RATIO s_normalized_cross/s_normalized score, 4-bit ({regime}) = {cross[regime][0] / q4[regime][0]:.3f}")
    print(f"RATIO per_task/unified bytes per round = {exact['bytes'] / unified['bytes']:.3f}")
    print(f"RATIO per_task 4-bit/unified bytes per round = {q4['bytes'] / unified['bytes']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
