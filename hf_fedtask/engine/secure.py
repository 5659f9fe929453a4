"""One simulated round under pairwise-mask secure aggregation (`hf_fedtask.core.secagg`), for strategies
with `secure_aggregation=True` (FedYolo's privacy variant).

Client side (`upload`): the strategy's update is flattened, fixed-point encoded and masked by the
client's `SecAggClient`; only its vectors travel, as int64, under a header that names no task
(sample counts and training metrics stay on the client). Those bytes are the uplink.

Server side (`receive`, `finish`): each upload is parsed against the int64 template (keys, shapes,
dtype, base model and PEFT config) and added to `SecAggServer`'s running sum, which keeps no
individual upload; clients that dropped after the key exchange are recovered through the
survivors' revealed pair seeds. `finish` returns the decoded sum as ONE `ClientUpdate`: the only
thing the strategy's `server_aggregate` receives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hf_fedtask.errors import ConfigError
from hf_fedtask.core.secagg import SecAggClient, SecAggServer
from hf_fedtask.strategies import GlobalState
from hf_fedtask.core.taskvector import TaskVector, make_metadata
from hf_fedtask.core.wire import ClientUpdate, pack_vectors, unpack_vectors

if TYPE_CHECKING:
    from hf_fedtask.engine.run import Simulation


class SecureRound:
    """The key exchange of one round's participants, then their masked uploads and the sum."""

    def __init__(self, sim: Simulation, state: GlobalState, round_: int, clients: list[int]):
        if len(clients) < 2:
            raise ConfigError(f"secure_aggregation needs at least 2 clients per round, round {round_} samples "
                              f"{len(clients)}: raise participation or num_clients")
        self.round = round_
        self.header = sim.header()
        first = clients[0]
        layout = pack_vectors(sim.strategy.update_templates(state, first, sorted(sim.client_data[first])))
        self.template = TaskVector({k: torch.zeros(t.shape, dtype=torch.int64) for k, t in layout.items()})
        self.server = SecAggServer(self.template, round_)
        self.clients = {cid: SecAggClient(cid, seed=sim.config.seed) for cid in clients}
        for cid, client in self.clients.items():
            self.server.register(cid, client.public_key)
        self.peers = self.server.public_keys

    def upload(self, update: ClientUpdate) -> bytes:
        """Client side: the masked upload's bytes."""
        masked = self.clients[update.client_id].mask(pack_vectors(update.vectors), self.round, self.peers)
        meta = make_metadata(**self.header, kind="delta", task_ids=[], client_id=update.client_id, round=self.round)
        return masked.to_bytes(metadata={**meta, **masked.raw_metadata})

    def receive(self, client_id: int, payload: bytes) -> None:
        """Server side: validate a masked upload and add it to the running sum."""
        source = f"client {client_id} (round {self.round}, masked)"
        masked = TaskVector.from_bytes(payload, source=source, template=self.template, expect=self.header)
        self.server.receive(client_id, masked)

    def finish(self) -> ClientUpdate:
        """Server side: the sum of the round's updates (masks removed), as one update."""
        survivors = {cid: self.clients[cid] for cid in self.server.received}
        total = self.server.finish(survivors)
        return ClientUpdate(client_id=-1, round=self.round, vectors=unpack_vectors(total), num_samples={})


def open_secure_round(sim: Simulation, state: GlobalState, round_: int, clients: list[int]) -> SecureRound | None:
    """The round's secure aggregation, or None when the strategy does not ask for it."""
    if not getattr(sim.strategy, "secure_aggregation", False):
        return None
    return SecureRound(sim, state, round_, clients)
