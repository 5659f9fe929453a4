"""The clients' learning rate round by round (`lr_round_schedule`): constant, or annealed by a cosine over the
run's rounds as FlowerTune LLM's template apps do (their client_app's `cosine_annealing`, which sets each round's
`TrainingArguments.learning_rate`; the within-round `lr_scheduler` then starts from it).

Hand-written because the rate is a function of the server round, which no transformers or torch scheduler sees:
those restart with every local `Trainer`. Light on purpose (no torch): the server's round records use it too.
"""

from __future__ import annotations

import math

ROUND_SCHEDULES = ("constant", "cosine")


def cosine_annealing(current_round: int, total_round: int, lrate_max: float = 0.001, lrate_min: float = 0.0) -> float:
    """FlowerTune's rate of round `current_round` (1-based) of `total_round`: `lrate_max` annealed to `lrate_min`,
    reached at the last round."""
    cos_inner = math.pi * current_round / total_round
    return lrate_min + 0.5 * (lrate_max - lrate_min) * (1 + math.cos(cos_inner))


def round_learning_rate(schedule: str, round_: int, rounds: int, learning_rate: float, learning_rate_min: float
                        ) -> float:
    """The clients' learning rate in round `round_` of `rounds` under `schedule` (one of ROUND_SCHEDULES)."""
    if schedule == "constant":
        return learning_rate
    if schedule == "cosine":
        return cosine_annealing(round_, rounds, learning_rate, learning_rate_min)
    raise ValueError(f"unknown lr_round_schedule {schedule!r}; one of {', '.join(ROUND_SCHEDULES)}")
