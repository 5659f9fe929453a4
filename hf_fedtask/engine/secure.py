"""The server half of pairwise-mask secure aggregation (`hf_fedtask.core.secagg`) for one round; the
client half (masking) runs on each client (`hf_fedtask.engine.client`).

The server relays the participants' public keys, parses each masked upload against the int64
template (keys, shapes, dtype, base model and PEFT config) and adds it to a running sum that keeps
no individual upload; clients that dropped after the key exchange are recovered by asking the
survivors for their pairwise seeds with them. `finish` returns the decoded sum as ONE
`ClientUpdate`: the only thing the strategy's `server_aggregate` receives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import torch

from hf_fedtask.core.secagg import SecAggServer
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, pack_vectors, unpack_vectors
from hf_fedtask.errors import SecAggError


class SecureAggregation:
    """One round: `register` public keys, `receive` masked uploads, `finish` into the sum."""

    def __init__(self, layout: dict[str, TaskVector], round_: int, header: dict):
        self.round = round_
        self.header = header
        self.template = TaskVector({k: torch.zeros(t.shape, dtype=torch.int64)
                                    for k, t in pack_vectors(layout).items()})
        self.server = SecAggServer(self.template, round_)

    def register(self, client_id: int, reply: bytes) -> None:
        """A client's public key, from its reply to the key query."""
        meta = TaskVector.from_bytes(reply, source=f"client {client_id} (round {self.round}, public key)",
                                     template={}, expect=self.header).raw_metadata
        self.server.register(client_id, int(meta["public_key"]))

    @property
    def peers(self) -> dict[str, str]:
        """The public keys every participant masks against, JSON-able."""
        return {str(c): str(k) for c, k in self.server.public_keys.items()}

    def receive(self, client_id: int, payload: bytes) -> None:
        """Validate a masked upload and add it to the running sum."""
        source = f"client {client_id} (round {self.round}, masked)"
        masked = TaskVector.from_bytes(payload, source=source, template=self.template, expect=self.header)
        self.server.receive(client_id, masked)

    def finish(self, reveal: Callable[[int, list[int]], dict[int, bytes]]) -> ClientUpdate:
        """The sum of the received updates (masks removed); `reveal(survivor, dropped)` asks a survivor
        for its pairwise seeds with the dropped clients."""
        survivors = {cid: _Revealer(cid, reveal) for cid in self.server.received}
        if len(survivors) < 2:
            raise SecAggError(f"secure aggregation, round {self.round}: {len(survivors)} upload(s) arrived; "
                              "at least 2 are needed")
        total = self.server.finish(survivors)
        return ClientUpdate(client_id=-1, round=self.round, vectors=unpack_vectors(total), num_samples={})


class _Revealer:
    """A survivor as `SecAggServer.finish` asks it: through the engine's transport."""

    def __init__(self, client_id: int, reveal: Callable[[int, list[int]], dict[int, bytes]]):
        self.client_id, self._reveal = client_id, reveal

    def reveal_pair_seeds(self, dropped_ids: Iterable[int], round: int) -> dict[int, bytes]:
        return self._reveal(self.client_id, sorted(dropped_ids))


def parse_seeds(reply: bytes, source: str) -> dict[int, bytes]:
    """The pairwise seeds in a reveal reply."""
    meta = TaskVector.from_bytes(reply, source=source, template={}).raw_metadata
    return {int(c): bytes.fromhex(s) for c, s in json.loads(meta["seeds"]).items()}
