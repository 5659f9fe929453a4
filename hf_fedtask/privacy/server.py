"""The server's side of client-level DP, wrapped around a strategy's aggregation as Flower's
`DifferentialPrivacyServerSideFixedClipping` wraps a Strategy. `PrivateAggregation` (one per run) owns

    sampling    each round's client sample, drawn secretly (`sampling.secret_sample`), never from the run seed
    σ           the settings' σ, pinned per round in the state (`SIGMAS`) so a resumed run accounts every round at
                the σ it used; under a target ε, a run resumed with another length recalibrates σ for its
                remaining rounds so that the rounds run (at their σ) and the remaining ones meet the target
                (`PLAN`: the length and σ the remaining rounds follow), and refuses when the budget is spent
    accountant  ε after each round from the rounds' σ's (`accountant.RunningAccountant`)

and opens a `PrivateRound` per round, which owns the instruction config of the clients mode (σ and each entry's
number of contributors, `upload.SHARES`), the uniform weights, re-clip and noise (`aggregation`), the strategy's
`private_aggregate`, and the round's record: its `privacy` entry, the sampled ids kept private
(`report.private_record`).
"""

from __future__ import annotations

import dataclasses

from hf_fedtask.core.state import GlobalState
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError, FedTaskError
from hf_fedtask.privacy.accountant import RunningAccountant, calibrate, schedule_epsilon
from hf_fedtask.privacy.aggregation import add_central_noise, clipped_fraction, contributors, uniform
from hf_fedtask.privacy.noise import CLIENTS
from hf_fedtask.privacy.report import private_record
from hf_fedtask.privacy.sampling import secret_sample
from hf_fedtask.privacy.settings import PrivacySettings, json_epsilon
from hf_fedtask.privacy.upload import SHARES

SIGMAS = "dp_noise_multipliers"  # state scalar: the σ of every round run so far, in order
PLAN = "dp_plan"  # state scalar under a target ε: {"rounds": R, "noise_multiplier": σ} the rounds up to R follow
SPENT = 0.99  # a resumed target-ε run whose rounds spent this share of the target has nothing useful left


class PrivateAggregation:
    """Client-level DP around `strategy`'s aggregation, with `settings` resolved (see the module docstring)."""

    def __init__(self, strategy, settings: PrivacySettings):
        self.strategy, self.settings = strategy, settings
        self.accountant = RunningAccountant(settings.population, settings.sample, settings.delta)

    def sample(self, eligible: list[int], size: int, round_: int) -> list[int]:
        """Round `round_`'s `size` of the `eligible` clients, drawn secretly (or from dp_noise_seed when given)."""
        return secret_sample(eligible, size, round_, self.settings.noise_seed)

    def sigma(self, state: GlobalState) -> float:
        """The σ of the rounds after `state`, or a one-line ConfigError: a state with rounds whose σ is not recorded,
        or a target ε whose budget the rounds run already spent."""
        s = self.settings
        past = [float(x) for x in state.scalars.get(SIGMAS, [])]
        if len(past) != state.round:
            raise ConfigError(f"dp_clip: the state this run continues from has {state.round - len(past)} round(s) "
                              "without a recorded noise multiplier (run without client-level DP, or checkpointed "
                              "before σ was recorded), whose privacy cannot be accounted: start the run afresh")
        if s.target_epsilon is None or not past:
            return s.noise_multiplier
        plan = state.scalars.get(PLAN)
        if plan is not None and plan["rounds"] == s.rounds:
            return float(plan["noise_multiplier"])
        remaining = s.rounds - state.round
        if remaining <= 0:  # nothing left to run
            return past[-1]
        spent = schedule_epsilon(s.population, s.sample, past, s.delta)
        if spent >= SPENT * s.target_epsilon:
            raise ConfigError(f"dp_epsilon: the {len(past)} round(s) run spent ε = {spent:.4g} of the target "
                              f"{s.target_epsilon:g} at δ = {s.delta:g}: nothing is left for {remaining} more "
                              f"(rounds {s.rounds})")
        try:
            return calibrate(s.population, s.sample, remaining, s.target_epsilon, s.delta, tuple(past))
        except Exception as e:  # dp-accounting's bracket search fails when no σ in range reaches the target
            raise ConfigError(f"dp_epsilon: cannot calibrate σ for the {remaining} remaining round(s) to ε = "
                              f"{s.target_epsilon:g} at δ = {s.delta:g} after the {len(past)} run "
                              f"(ε = {spent:.4g}) ({type(e).__name__}: {e})") from None

    def start(self, state: GlobalState) -> None:
        """Refuse, before anything is written, a state whose remaining rounds cannot be accounted (`sigma`)."""
        self.sigma(state)

    def open(self, state: GlobalState, round_: int, trains: bool) -> PrivateRound:
        """Round `round_` from `state` (after the strategy's `server_step`); `trains`: a train round (DP rounds
        are: a query's replies are neither clipped nor noised)."""
        if not trains:
            raise FedTaskError(f"round {round_}: strategy {self.strategy.name!r} asks a query round under "
                               "client-level DP, whose replies are neither clipped nor noised")
        return PrivateRound(self, state, round_, self.sigma(state))


class PrivateRound:
    """One DP round: `templates` of the uploads, `configure` the instruction, `aggregate`, `publish` the record."""

    uniform_counts = True  # every upload reports 1 sample per task held

    def __init__(self, owner: PrivateAggregation, state: GlobalState, round_: int, sigma: float):
        self.owner, self.state, self.round, self.sigma = owner, state, round_, sigma
        self.settings = dataclasses.replace(owner.settings, noise_multiplier=sigma)
        self.instructed: dict[str, int] = {}  # each upload entry's number of contributors this round
        self.clipped: float | None = None

    def templates(self, client: int, tasks: list[str]) -> dict:
        return self.owner.strategy.private_templates(self.state, client, tasks)

    def configure(self, clients: list[int]) -> dict:
        """The instruction config of the round's `clients`: in the clients mode, σ and each entry's number of
        contributors h (each adds its share N(0, σ²C²/h))."""
        allocation = self.state.allocation
        self.instructed = contributors({c: self.templates(c, allocation[c]) for c in clients},
                                       self.owner.strategy.public_entries)
        if self.settings.noise != CLIENTS:
            return {}
        return {SHARES: {"noise_multiplier": self.sigma, "contributors": self.instructed}}

    def aggregate(self, updates: list[ClientUpdate], summed_from: int | None = None) -> GlobalState:
        """The state after `updates` (or, `summed_from`, the one secure-aggregation sum of that many uploads):
        uniform weights, re-clip (individual uploads only) and noise, the strategy's `private_aggregate`; the
        round's σ pinned in the state."""
        strategy, s = self.owner.strategy, self.settings
        self.clipped = clipped_fraction(updates)
        received = {n: summed_from for n in self.instructed} if summed_from is not None else None
        noised = add_central_noise(uniform(updates), s, self.round, strategy.public_entries, self.instructed,
                                   received, summed=summed_from is not None)
        new = strategy.private_aggregate(self.state, noised)
        pinned = {SIGMAS: [*self.state.scalars.get(SIGMAS, []), self.sigma]}
        if s.target_epsilon is not None:
            pinned[PLAN] = {"rounds": s.rounds, "noise_multiplier": self.sigma}
        return dataclasses.replace(new, scalars={**new.scalars, **pinned})

    def publish(self, record: dict) -> dict:
        """The round's metrics record with its `privacy` entry (ε spent up to this round at every round's own σ,
        and the mechanism's values; `clipped_fraction`, the share of this round's uploads their clients clipped,
        is published outside ε, unknown (None) under secure aggregation) and the sampled ids kept private."""
        s = self.settings
        sigmas = [*self.state.scalars.get(SIGMAS, []), self.sigma]
        record = {**record, "privacy": {
            "epsilon": json_epsilon(self.owner.accountant.epsilon(sigmas)), "delta": s.delta,
            "noise_multiplier": self.sigma, "clip": s.clip, "clipped_fraction": self.clipped, "noise": s.noise,
            "accountant": "dp-accounting RDP"}}
        return private_record(record)
