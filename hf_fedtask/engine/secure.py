"""Pairwise-mask secure aggregation (`hf_fedtask.core.secagg`) in the engine, both halves.

Server: `SecureRound` is one round as the round loop drives it (the key exchange, the masked receipt, the
reveal), over `SecureAggregation`: the server relays the participants' public keys, parses each masked upload
against the int64 template (keys, shapes, dtype, base model and PEFT config) at the trust boundary
(`hf_fedtask.engine.trust`) and adds it to a running sum that keeps no individual upload; clients that dropped
after the key exchange are recovered by asking the survivors for their pairwise seeds with them. `finish`
returns the decoded sum as ONE `ClientUpdate`, marked as a sum of that many uploads for the round's aggregation
(the DP wrapper never re-clips it, and never trusts a client id to tell a sum from an upload).

Client: `MaskingStep` is the step a client applies to its update after `client_update` (and after the DP step),
as Flower's secure-aggregation mod follows a ClientApp: it masks the update against the round's peers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hf_fedtask.core.secagg import SecAggClient, SecAggServer
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.taskvector_file import make_metadata
from hf_fedtask.core.wire import ClientUpdate, pack_vectors, unpack_vectors
from hf_fedtask.engine.messages import SECAGG_PEERS, SECAGG_PUBLIC_KEY, SECAGG_REVEAL, Instruction
from hf_fedtask.engine.trust import accept_fields
from hf_fedtask.errors import FedTaskError, SecAggError
from hf_fedtask.strategies import QUERY

EMPTY = TaskVector({}).to_bytes()


class SecureAggregation:
    """One round: `register` public keys, `receive` masked uploads, `finish` into the sum."""

    def __init__(self, layout: dict[str, TaskVector], round_: int, header: dict):
        self.round = round_
        self.header = header
        self.template = TaskVector({k: torch.zeros(t.shape, dtype=torch.int64)
                                    for k, t in pack_vectors(layout).items()})
        self.server = SecAggServer(self.template, round_)

    def register(self, client_id: int, reply: TaskVector) -> None:
        """A client's public key, from its reply to the key query (checked at the trust boundary,
        `hf_fedtask.engine.trust.accept_fields`); a key outside the group is a SecAggError."""
        key = reply.raw_metadata["public_key"]
        if not key.isdigit():
            raise SecAggError(f"round {self.round}: client {client_id}: public key {key[:40]!r} is not a decimal "
                              "integer")
        self.server.register(client_id, int(key))

    @property
    def peers(self) -> dict[str, str]:
        """The public keys every participant masks against, JSON-able."""
        return {str(c): str(k) for c, k in self.server.public_keys.items()}

    def receive(self, client_id: int, masked: TaskVector) -> int:
        """Add a masked upload, checked against `template` at the trust boundary, to the running sum;
        returns its number of elements."""
        self.server.receive(client_id, masked)
        return masked.numel()

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


def parse_seeds(reply: TaskVector, source: str) -> dict[int, bytes]:
    """The pairwise seeds in a reveal reply (checked at the trust boundary); SecAggError where they do not parse."""
    try:
        seeds = json.loads(reply.raw_metadata["seeds"])
        return {int(c): bytes.fromhex(s) for c, s in seeds.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise SecAggError(f"{source}: the seeds do not parse ({type(e).__name__}: {e})") from None


class SecureRound:
    """One secure-aggregation round as the round loop drives it: `admit` runs the key exchange (the clients whose
    public key arrived and passed the trust boundary take part), `config` carries their keys in the train
    instruction, `receive` checks each masked upload and adds it to the running sum, `finish` has the survivors
    reveal their pair seeds with the dropped clients and returns the sum. `layout(client)`: the vectors a client
    uploads (every client's is the same); `admit(refused, client, accept)`: the round loop's handling of a reply
    that fails the trust boundary (`Server._admit`)."""

    def __init__(self, layout: Callable[[int], dict[str, TaskVector]], round_: int, header: dict, transport,
                 admit: Callable):
        self.layout, self.round, self.header, self.transport, self._admit = layout, round_, header, transport, admit
        self.secure: SecureAggregation | None = None

    def admit(self, clients: list[int]) -> list[int]:
        """The key exchange with the sampled `clients`; returns those that take part."""
        self.secure = SecureAggregation(self.layout(clients[0]), self.round, self.header)
        keys = self.transport.exchange([Instruction(QUERY, self.round, c, EMPTY, {"query": SECAGG_PUBLIC_KEY})
                                        for c in clients])
        refused: dict[int, str] = {}
        for c in clients:
            if c in keys:
                self._admit(refused, c, lambda c=c: self.secure.register(c, accept_fields(
                    keys[c], sender=c, round_=self.round, header=self.header, fields=("public_key",),
                    what="public key")))
        return [c for c in clients if c in keys and c not in refused]

    @property
    def config(self) -> dict:
        """The train instruction's part: the public keys every participant masks against."""
        return {SECAGG_PEERS: self.secure.peers}

    def receive(self, client: int, reply: bytes) -> int:
        """A masked upload, checked (identity, round, int64 layout) and added to the sum; its number of elements."""
        return self.secure.receive(client, accept_fields(reply, sender=client, round_=self.round, header=self.header,
                                                         template=self.secure.template, what="masked upload"))

    def finish(self) -> tuple[list[ClientUpdate], int]:
        """([the sum of the received uploads], how many uploads it adds)."""
        return [self.secure.finish(self._reveal)], len(self.secure.server.received)

    def _reveal(self, survivor: int, dropped: list[int]) -> dict[int, bytes]:
        ins = Instruction(QUERY, self.round, survivor, EMPTY, {"query": SECAGG_REVEAL, "dropped": dropped,
                                                               "peers": self.secure.peers})
        reply = self.transport.exchange([ins])
        if survivor not in reply:
            why = self.transport.failures.get(survivor, "no reply")
            raise FedTaskError(f"secure aggregation, round {self.round}: survivor {survivor} did not reveal its seeds "
                               f"(client {survivor}: {why})")
        return parse_seeds(accept_fields(reply[survivor], sender=survivor, round_=self.round, header=self.header,
                                         fields=("seeds",), what="pairwise seeds"),
                           source=f"client {survivor} (round {self.round}, seeds)")


@dataclass
class MaskedUpload:
    """A client's masked update as it is sent: int64, under a header that names no task (sample counts and
    training metrics stay on the client)."""

    masked: TaskVector
    client_id: int
    round: int

    def to_bytes(self, **header: str) -> bytes:
        meta = make_metadata(**header, kind="delta", task_ids=[], client_id=self.client_id, round=self.round)
        return self.masked.to_bytes(metadata={**meta, **self.masked.raw_metadata})


class MaskingStep:
    """The client's secure-aggregation step: its update flattened, fixed-point encoded and masked against the
    round's peers (`SECAGG_PEERS` of the instruction) by `secagg`."""

    def __init__(self, secagg: SecAggClient):
        self.secagg = secagg

    def __call__(self, update: ClientUpdate, ins: Instruction, job) -> MaskedUpload:
        peers = {int(c): int(k) for c, k in ins.config[SECAGG_PEERS].items()}
        return MaskedUpload(self.secagg.mask(pack_vectors(update.vectors), ins.round, peers), self.secagg.client_id,
                            ins.round)
