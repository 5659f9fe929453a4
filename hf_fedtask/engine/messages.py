"""What engines move: an instruction from the server to one client, answered by bytes.

Both directions are safetensors bytes (`hf_fedtask.core.wire`), so an engine never pickles and the
server validates every reply the same way whichever engine carried it. `config` holds the few
JSON-able values that are not tensors (the query asked, the secure-aggregation peers' public keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hf_fedtask.core.kinds import KINDS

# queries the engine itself asks (strategies' own queries are any other name)
SECAGG_PUBLIC_KEY = "secagg/public_key"
SECAGG_REVEAL = "secagg/reveal"
SECAGG_PEERS = "secagg_peers"  # a train instruction's config key: the round's public keys, to mask against


@dataclass
class Instruction:
    kind: str  # train | query | evaluate
    round: int
    client_id: int
    payload: bytes  # the downlink: named vectors packed into one safetensors blob
    config: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown message kind {self.kind!r}; one of {', '.join(KINDS)}")

    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True)
