"""The server's state between rounds, and a client's private store.

A state is named task vectors (e.g. `shared` PEFT modules and one `head/<task>` per task) plus
JSON-able scalars (the task allocation, a strategy's phase). A strategy may change the names it
keeps from one phase to the next; checkpoints record the names they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_fedtask.core.taskvector import TaskVector

SHARED = "shared"
HEAD = "head/"


def head_name(task: str) -> str:
    """Name of the vector holding `task`'s classification head in states and updates."""
    return f"{HEAD}{task}"


@dataclass
class GlobalState:
    """Server state after `round` finished rounds."""

    round: int
    vectors: dict[str, TaskVector]
    scalars: dict = field(default_factory=dict)

    @property
    def allocation(self) -> dict[int, list[str]]:
        """Client id -> the tasks it holds."""
        return {int(c): tasks for c, tasks in self.scalars["allocation"].items()}

    def holders(self, task: str) -> list[int]:
        return [c for c, tasks in self.allocation.items() if task in tasks]

    def heads(self, tasks: list[str]) -> dict[str, TaskVector]:
        """The `head/<task>` vectors of `tasks`."""
        return {head_name(t): self.vectors[head_name(t)] for t in tasks}

    def next(self, vectors: dict[str, TaskVector], **scalars) -> GlobalState:
        """The state of the following round: `vectors` replace this state's of the same name; `scalars` update."""
        return GlobalState(round=self.round + 1, vectors={**self.vectors, **vectors}, scalars={**self.scalars, **scalars})


ClientStore = dict[str, TaskVector]
"""A client's private, persistent tensors (e.g. FedPer's personal layers, SCAFFOLD's control variate).
They never travel; the engine that hosts the client keeps them (the in-process engine checkpoints
them with the server state, as the clients' own disks; a Flower client keeps them in its node state)."""
