"""How instructions reach clients: the one interface every engine implements, and the in-process one.

An engine's transport only moves bytes: it delivers each `Instruction` to its client and returns
the replies by client id. Sampling, validation, aggregation, evaluation, byte accounting, metrics
and checkpoints happen in the shared round loop (`hf_fedtask.engine.server`), identical for every
engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tqdm.auto import tqdm

from hf_fedtask.core.state import ClientStore
from hf_fedtask.engine.client import ClientRuntime, train_replies
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.messages import Instruction
from hf_fedtask.strategies import TRAIN


class Transport(ABC):
    """Delivers instructions, returns {client id: reply bytes}; a client whose reply did not come back
    is absent, with the reason in `failures`."""

    name: str = "transport"

    def __init__(self):
        self.failures: dict[int, str] = {}

    @abstractmethod
    def exchange(self, instructions: list[Instruction]) -> dict[int, bytes]: ...

    @property
    def stores(self) -> dict[int, ClientStore] | None:
        """The clients' private stores when this engine hosts them in this process (they are then
        checkpointed with the server state), else None (they live with the clients)."""
        return None

    def evaluate(self, server, state, names: list[str]) -> dict[str, dict]:
        """The server's evaluation of tasks `names` (`Server.evaluate_tasks`): here, in this process; an
        engine with several processes of its own may share the tasks among them."""
        return server.evaluate_tasks(state, names)

    def close(self) -> None:
        """Release what the transport holds (connections, processes)."""


class InProcessTransport(Transport):
    """Every client runs here, one after the other, on the environment's one host model."""

    name = "in-process"

    def __init__(self, env: Environment, stores: dict[int, ClientStore] | None = None):
        super().__init__()
        self.env = env
        self._stores: dict[int, ClientStore] = stores if stores is not None else {}

    @property
    def stores(self) -> dict[int, ClientStore]:
        return self._stores

    def exchange(self, instructions: list[Instruction]) -> dict[int, bytes]:
        if (len(instructions) > 1 and all(i.kind == TRAIN for i in instructions)
                and self.env.strategy.trains_clients_together(self.env.trainer)):
            # the round's clients handed over together, so the strategy may train them together
            return train_replies([self.runtime(i.client_id) for i in instructions], instructions,
                                 [self._stores.setdefault(i.client_id, {}) for i in instructions])
        replies = {}
        desc = f"round {instructions[0].round} {instructions[0].kind}" if instructions else ""
        for ins in tqdm(instructions, desc=desc, leave=False, dynamic_ncols=True, disable=len(instructions) < 2):
            replies[ins.client_id] = self.runtime(ins.client_id).handle(ins, self._stores.setdefault(ins.client_id, {}))
        return replies

    def runtime(self, client_id: int) -> ClientRuntime:
        """Client `client_id` as this process runs it: here with the run seed as its secure-aggregation
        secret, so a simulation repeats exactly (a simulation of the protocol, not a protection)."""
        return ClientRuntime(self.env, client_id)
