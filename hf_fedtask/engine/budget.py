"""A run's communication budget (`comm_budget_mb`), counted as FlowerTune LLM counts its 200,000 MB.

FlowerTune's `CommunicationTracker` (flwrlabs/flower, `examples/flowertune-llm-*/flowertune_*/strategy.py`)
adds up, round after round, the parameters in every train message the server sends to a sampled client and in
every reply (`ArrayRecord.count_bytes()`: each array's serialized bytes and its key), divided by 1024**2 and
called MB. hf_fedtask sends the same parameters as one safetensors blob each way, and this count is those wire
bytes: metrics.jsonl's `bytes_downlink` + `bytes_uplink` (a safetensors header of names, shapes and dtypes where
FlowerTune counts .npy headers and keys; on SmolLM2-135M's LoRA r=32 adapter the two differ by 0.1%).

FlowerTune only logs a warning once its count passes 200,000 MB. Here the budget is a limit:

- before the first round (`Server.start`), a run whose remaining rounds would need more than what is left,
  estimated from the next round's layout (`plan`), is refused before anything is written;
- before each round, a round that would take the count past the budget is not started (`before_round`): its
  downlink is measured, its replies are estimated from the layout the server expects of them (an upper
  bound: their tensors' bytes, a header entry per tensor and room for the reply's metadata).

Either refusal is a one-line ConfigError (exit 2 from the CLI); a run stopped before a round keeps the rounds
it finished and resumes with a larger budget, or with `--rounds` at the last finished round to end there.
A strategy whose server works alone before its first round (F²L²'s pretraining) is checked round by round only.
"""

from __future__ import annotations

from collections.abc import Mapping

from hf_fedtask.core.state import GlobalState
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import SEPARATOR
from hf_fedtask.errors import ConfigError
from hf_fedtask.strategies import TRAIN
from hf_fedtask.strategies.base import Strategy

MB = 1024**2  # FlowerTune's "MB"
HEADER_ENTRY = 128  # a safetensors header entry besides its key: dtype, shape, data offsets, JSON punctuation
REPLY_METADATA = 4096  # a reply's header metadata: base model, revision, PEFT config hash, client, round, ...
REPLY_METADATA_PER_TASK = 256  # ... and per task held: its name, sample count and metrics


def wire_size(vectors: Mapping[str, TaskVector], *, integer: bool = False, tasks: int = 0) -> int:
    """An upper bound of the bytes `pack_vectors(vectors)` takes on the wire with a reply's metadata for
    `tasks` tasks: each tensor's data (int64 under secure aggregation, `integer`), a header entry and the
    metadata allowance."""
    size = 8 + REPLY_METADATA + REPLY_METADATA_PER_TASK * tasks
    for name, tv in vectors.items():
        entry = HEADER_ENTRY + len(name) + len(SEPARATOR)
        size += entry if not len(tv) else 0  # an empty vector travels as one empty tensor
        for key, t in tv.items():
            size += t.numel() * (8 if integer else t.element_size()) + entry + len(key)
    return size


def round_estimate(strategy: Strategy, state: GlobalState, clients: list[int], sampled: int) -> int | None:
    """The bytes of a round from `state`: the `sampled` clients of `clients` that move the most, each its
    downlink and its reply (`wire_size`, both upper bounds). None for a strategy whose server works alone
    before a round (its `server_step`), whose layout the state does not tell yet."""
    if type(strategy).server_step is not Strategy.server_step:
        return None
    secure = strategy.capabilities.secure_aggregation and strategy.message_kind(state) == TRAIN
    allocation = state.allocation
    sizes = sorted((wire_size(strategy.downlink(state, c, allocation[c]), tasks=len(allocation[c]))
                    + wire_size(strategy.update_templates(state, c, allocation[c]), integer=secure,
                                tasks=len(allocation[c])) for c in clients), reverse=True)
    return sum(sizes[:sampled])


class CommBudget:
    """The bytes a run has moved (both directions, every round) against `limit_mb` MB of 2**20 bytes."""

    def __init__(self, limit_mb: float):
        self.limit_mb = limit_mb
        self.limit = limit_mb * MB
        self.used = 0

    def start(self, history: list[dict], remaining: int, per_round: int | None) -> None:
        """The rounds already run (`history`, a resumed run's) count; refuse `remaining` rounds of about
        `per_round` bytes (None: not estimated) that would take the run past the budget."""
        self.used = sum(h["bytes_uplink"] + h["bytes_downlink"] for h in history)
        if per_round is None or remaining <= 0:
            return
        need = self.used + remaining * per_round
        if need > self.limit:
            spent = f" on top of the {self.used / MB:,.2f} MB used" if self.used else ""
            raise ConfigError(f"comm_budget_mb {self.limit_mb:g}: {remaining} round(s) of about {per_round / MB:,.2f} "
                              f"MB (parameters both ways) need about {need / MB:,.2f} MB{spent}, more than the "
                              "budget; raise comm_budget_mb, or lower rounds or participation")

    def before_round(self, round_: int, sent: Mapping[int, bytes], replies: Mapping[int, int]) -> float:
        """Refuse round `round_` when its downlink (`sent`, measured) and the estimated `replies` (bytes per
        client) would take the run past the budget; the round's estimate in MB otherwise."""
        down, up = sum(len(b) for b in sent.values()), sum(replies.values())
        if self.used + down + up > self.limit:
            last = round_ - 1
            stop = (f"the run stops after round {last} (resume it with --rounds {last} to end there, or with a "
                    "larger --comm-budget-mb)") if last else "no round ran"
            raise ConfigError(f"comm_budget_mb {self.limit_mb:g}: round {round_} would move {(down + up) / MB:,.2f} MB "
                              f"({down / MB:,.2f} MB sent, about {up / MB:,.2f} MB of replies) on top of the "
                              f"{self.used / MB:,.2f} MB used, past the budget; {stop}")
        return (down + up) / MB

    def spend(self, record: dict, estimate_mb: float) -> dict:
        """Count a finished round's record; what metrics.jsonl's `comm_budget` says of it."""
        round_bytes = record["bytes_uplink"] + record["bytes_downlink"]
        self.used += round_bytes
        return {"round_mb": round_bytes / MB, "estimate_mb": estimate_mb, "used_mb": self.used / MB,
                "budget_mb": self.limit_mb}
