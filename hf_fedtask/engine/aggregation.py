"""What samples and aggregates a round for the round loop (`hf_fedtask.engine.server`): the strategy itself
(`StrategyAggregation`), or the strategy wrapped in client-level DP (`hf_fedtask.privacy.server.PrivateAggregation`,
the same interface), chosen once per run by `choose`.

The interface: `sample(eligible, size, round_)` the round's clients; `start(state)` what the state a run continues
from decides before anything is written; `open(state, round_, trains)` a round object with `templates(client,
tasks)` (the layout of a client's upload), `configure(clients)` (the instruction config it adds),
`uniform_counts` (whether uploads report 1 sample per task held), `aggregate(updates, summed_from)` (the new
state; `summed_from`: the updates are one secure-aggregation sum of that many uploads) and `publish(record)` (the
round's metrics record as it is written).
"""

from __future__ import annotations

import numpy as np

from hf_fedtask.core.state import GlobalState
from hf_fedtask.core.wire import ClientUpdate


class StrategyAggregation:
    """The strategy's own aggregation, with the seeded sample: a function of the public (seed, round) only, so a
    run repeats exactly."""

    def __init__(self, strategy, seed: int):
        self.strategy, self.seed = strategy, seed

    def sample(self, eligible: list[int], size: int, round_: int) -> list[int]:
        rng = np.random.default_rng([self.seed, round_])
        return sorted(int(c) for c in rng.choice(eligible, size=size, replace=False))

    def start(self, state: GlobalState) -> None:
        """Nothing to decide: every round aggregates the same way."""

    def open(self, state: GlobalState, round_: int, trains: bool) -> StrategyRound:
        return StrategyRound(self.strategy, state)


class StrategyRound:
    """One round aggregated by the strategy's `server_aggregate` from its `update_templates`' uploads."""

    uniform_counts = False

    def __init__(self, strategy, state: GlobalState):
        self.strategy, self.state = strategy, state

    def templates(self, client: int, tasks: list[str]) -> dict:
        return self.strategy.update_templates(self.state, client, tasks)

    def configure(self, clients: list[int]) -> dict:
        return {}

    def aggregate(self, updates: list[ClientUpdate], summed_from: int | None = None) -> GlobalState:
        return self.strategy.server_aggregate(self.state, updates)

    def publish(self, record: dict) -> dict:
        return record


def choose(strategy, seed: int, privacy):
    """The run's aggregation: `PrivateAggregation` when `privacy` (resolved `PrivacySettings`) is set, else the
    strategy's own."""
    if privacy is None:
        return StrategyAggregation(strategy, seed)
    from hf_fedtask.privacy.server import PrivateAggregation

    return PrivateAggregation(strategy, privacy)
