"""The privacy spent by a run, accounted by Google's dp-accounting (`pip install dp-accounting`): its Rényi DP
accountant (Mironov, "Rényi Differential Privacy", CSF 2017) converted to (ε, δ).

The events model the sampling exactly as `Server.sample_clients` draws it: each round a seeded sample of a
fixed size m out of the N eligible clients, without replacement. The seed is public, but the accountant
assumes an adversary who cannot predict the sample (amplification by subsampling is the only thing the seed
would weaken; pass participation 1 if that matters). With the number of clients public, neighbouring
federations differ by replacing one client's data (replace-one adjacency), the relation dp-accounting's
`SampledWithoutReplacementDpEvent` is defined for (Wang, Balle and Kasiviswanathan, "Subsampled Rényi
Differential Privacy and Analytical Moments Accountant", AISTATS 2019). Replacing a client moves the
concatenation of all aggregated sums by up to 2C (its old and new uploads both have norm <= C), so noise
σ·C is a Gaussian mechanism of noise multiplier σ/2 in dp-accounting's terms (std / L2 sensitivity). With
full participation (m = N) a round is that plain Gaussian, composed once per round.
"""

from __future__ import annotations

import functools
import math

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

ACCOUNTANT = ("dp-accounting RDP accountant (Rényi DP, Mironov 2017), replace-one adjacency; sampling without "
              "replacement: Wang, Balle and Kasiviswanathan 2019")
REPLACE_ONE_SENSITIVITY = 2.0  # in units of C: replacing one client's clipped upload moves the sums by <= 2C


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


def fresh_accountant() -> RdpAccountant:
    return RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)


def epsilon(population: int, sample: int, noise_multiplier: float, rounds: int, delta: float) -> float:
    """ε at `delta` after `rounds` rounds (0 before any; inf without noise)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    accountant = fresh_accountant()
    accountant.compose(run_event(population, sample, noise_multiplier, rounds))
    return float(accountant.get_epsilon(delta))


@functools.lru_cache(maxsize=32)  # the server and results.json resolve the same run's σ
def calibrate(population: int, sample: int, rounds: int, target_epsilon: float, delta: float) -> float:
    """The smallest noise multiplier σ whose run spends at most `target_epsilon` at `delta`, by dp-accounting's
    own calibration (bisection over σ, each point accounted as `epsilon` does)."""
    return float(dp_accounting.calibrate_dp_mechanism(
        fresh_accountant, lambda sigma: run_event(population, sample, sigma, rounds), target_epsilon, delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(1e-3, 1e4), tol=1e-4))


class RunningAccountant:
    """ε after each round of one run, one round composed at a time (a resumed run composes its earlier
    rounds at once)."""

    def __init__(self, population: int, sample: int, noise_multiplier: float, delta: float):
        self.population, self.sample, self.noise_multiplier, self.delta = population, sample, noise_multiplier, delta
        self.rounds = 0
        self._accountant = fresh_accountant()

    def advance_to(self, rounds: int) -> float:
        """ε after `rounds` rounds of the run (composing those not yet composed)."""
        if self.noise_multiplier <= 0:
            self.rounds = rounds
            return math.inf
        if rounds < self.rounds:  # a run stepped again from an earlier state: account afresh
            self.rounds, self._accountant = 0, fresh_accountant()
        if rounds > self.rounds:
            event = round_event(self.population, self.sample, self.noise_multiplier)
            self._accountant.compose(event, rounds - self.rounds)
            self.rounds = rounds
        return float(self._accountant.get_epsilon(self.delta)) if rounds > 0 else 0.0
