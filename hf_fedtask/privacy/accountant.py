"""The privacy spent by a run, accounted by Google's dp-accounting (`pip install dp-accounting`): its Rényi DP
accountant (Mironov, "Rényi Differential Privacy", CSF 2017) converted to (ε, δ).

The events model the sampling as the DP wrapper draws it (`hf_fedtask.privacy.server`): each round a sample of a
fixed size m out of the N eligible clients, without replacement, drawn from secret randomness
(`hf_fedtask.privacy.sampling`), so the amplification by subsampling holds. With the number of clients public,
neighbouring federations differ by replacing one client's data (replace-one adjacency), the relation
dp-accounting's `SampledWithoutReplacementDpEvent` is defined for (Wang, Balle and Kasiviswanathan, "Subsampled
Rényi Differential Privacy and Analytical Moments Accountant", AISTATS 2019). Replacing a client moves the
concatenation of all aggregated sums by up to 2C (its old and new uploads both have norm <= C), so noise σ·C is a
Gaussian mechanism of noise multiplier σ/2 in dp-accounting's terms (std / L2 sensitivity). With full
participation (m = N) a round is that plain Gaussian, composed once per round.

Every round is accounted at the σ it used (a schedule: one σ per round), so a run resumed with another length,
whose remaining rounds use a recalibrated σ, reports what its rounds actually spent.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

ACCOUNTANT = ("dp-accounting RDP accountant (Rényi DP, Mironov 2017), replace-one adjacency; sampling without "
              "replacement: Wang, Balle and Kasiviswanathan 2019")
REPLACE_ONE_SENSITIVITY = 2.0  # in units of C: replacing one client's clipped upload moves the sums by <= 2C
BRACKET = (1e-3, 1e4)  # the σ calibration searches


def round_event(population: int, sample: int, noise_multiplier: float) -> dp_event.DpEvent:
    """One round: noise σ·C on sums of clipped uploads of `sample` clients drawn without replacement from
    `population` (a plain Gaussian when all take part)."""
    gaussian = dp_event.GaussianDpEvent(noise_multiplier / REPLACE_ONE_SENSITIVITY)
    if sample >= population:
        return gaussian
    return dp_event.SampledWithoutReplacementDpEvent(population, sample, gaussian)


def run_event(population: int, sample: int, noise_multiplier: float, rounds: int) -> dp_event.DpEvent:
    """`rounds` rounds of `round_event`."""
    return dp_event.SelfComposedDpEvent(round_event(population, sample, noise_multiplier), rounds)


def schedule_event(population: int, sample: int, sigmas: Sequence[float]) -> dp_event.DpEvent:
    """One round at each σ of `sigmas`, in order (consecutive equal σ's as one self-composed event)."""
    return dp_event.ComposedDpEvent([run_event(population, sample, sigma, len(list(group)))
                                     for sigma, group in itertools.groupby(sigmas)])


def fresh_accountant() -> RdpAccountant:
    return RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)


def epsilon(population: int, sample: int, noise_multiplier: float, rounds: int, delta: float) -> float:
    """ε at `delta` after `rounds` rounds at one σ (0 before any; inf without noise)."""
    return schedule_epsilon(population, sample, [noise_multiplier] * rounds, delta)


def schedule_epsilon(population: int, sample: int, sigmas: Sequence[float], delta: float) -> float:
    """ε at `delta` after one round at each σ of `sigmas` (0 before any; inf when a round had no noise)."""
    if not sigmas:
        return 0.0
    if min(sigmas) <= 0:
        return math.inf
    accountant = fresh_accountant()
    accountant.compose(schedule_event(population, sample, sigmas))
    return float(accountant.get_epsilon(delta))


@functools.lru_cache(maxsize=32)  # the server and results.json resolve the same run's σ
def calibrate(population: int, sample: int, rounds: int, target_epsilon: float, delta: float,
              past: tuple[float, ...] = ()) -> float:
    """The smallest noise multiplier σ such that the rounds already run (`past`, each at its σ) and `rounds` more at
    σ spend at most `target_epsilon` at `delta`, by dp-accounting's own calibration (bisection over σ, each point
    accounted as `schedule_epsilon` does). Raises (ValueError, dp-accounting's) when no σ in `BRACKET` reaches it."""
    before = [schedule_event(population, sample, past)] if past else []
    return float(dp_accounting.calibrate_dp_mechanism(
        fresh_accountant, lambda sigma: dp_event.ComposedDpEvent([*before, run_event(population, sample, sigma,
                                                                                      rounds)]),
        target_epsilon, delta, bracket_interval=dp_accounting.ExplicitBracketInterval(*BRACKET), tol=1e-4))


class RunningAccountant:
    """ε after each round of one run, from the schedule of σ's its rounds used: the rounds not yet composed are
    composed one at a time (a schedule that is not a continuation of the last one is accounted afresh: a resumed
    run, or one stepped again from an earlier state)."""

    def __init__(self, population: int, sample: int, delta: float):
        self.population, self.sample, self.delta = population, sample, delta
        self._sigmas: list[float] = []
        self._accountant = fresh_accountant()

    def epsilon(self, sigmas: Sequence[float]) -> float:
        """ε after one round at each σ of `sigmas`."""
        sigmas = [float(s) for s in sigmas]
        if sigmas[:len(self._sigmas)] != self._sigmas:
            self._sigmas, self._accountant = [], fresh_accountant()
        new = sigmas[len(self._sigmas):]
        if new and min(new) > 0:
            self._accountant.compose(schedule_event(self.population, self.sample, new))
        self._sigmas = sigmas
        if not sigmas:
            return 0.0
        if min(sigmas) <= 0:
            return math.inf
        return float(self._accountant.get_epsilon(self.delta))
