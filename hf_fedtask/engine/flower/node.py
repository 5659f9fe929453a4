"""What a SuperNode keeps for its client between messages, in Flower's per-node `context.state`.

In deployment every message starts a new ClientApp process, so nothing may live in module globals:
the client's private store (`ClientStore`) is kept as safetensors bytes and its secure-aggregation
secret (32 random bytes, drawn on the node's first message and never sent) as a ConfigRecord value.
Both stay on the node; the store is written back only after a message was handled successfully.
"""

from __future__ import annotations

import secrets

from flwr.app import ConfigRecord, Context

from hf_fedtask.core.state import ClientStore
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import pack_vectors, unpack_vectors
from hf_fedtask.engine.flower.records import PAYLOAD, payload_record, read_payload

STORE = "hf_fedtask.store"  # ArrayRecord: the packed store
SECRETS = "hf_fedtask.secrets"  # ConfigRecord: the secure-aggregation secret
SECAGG_SECRET = "secagg"


def node_secret(context: Context) -> bytes:
    """This node's secure-aggregation secret, drawn on first use and kept in its state."""
    record = context.state.config_records.get(SECRETS)
    if record is None or not isinstance(record.get(SECAGG_SECRET), bytes):
        record = ConfigRecord({SECAGG_SECRET: secrets.token_bytes(32)})
        context.state[SECRETS] = record
    return record[SECAGG_SECRET]


def load_store(context: Context) -> ClientStore:
    """The client's private store (empty on its first message)."""
    record = context.state.array_records.get(STORE)
    if record is None or PAYLOAD not in record:
        return {}
    data = read_payload(context.state, source=f"node {context.node_id}'s client store", key=STORE)
    return unpack_vectors(TaskVector.from_bytes(data, source=f"node {context.node_id}'s client store"))


def save_store(context: Context, store: ClientStore) -> None:
    context.state[STORE] = payload_record(pack_vectors(store).to_bytes())
