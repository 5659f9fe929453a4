"""What a SuperNode keeps for its client between messages, in Flower's per-node `context.state`.

In deployment every message starts a new ClientApp process, so nothing may live in module globals:
the client's private store (`ClientStore`) is kept as safetensors bytes and its secure-aggregation
secret (32 random bytes, drawn on the node's first message) as a ConfigRecord value. Neither is sent to
the server. With a warm worker (`hf_fedtask.engine.flower.worker`) both go with each message over the
node's local Unix socket to that worker, only after it proved it holds the worker's key (a 0600 file of
this user's, beside the socket by default); they never leave the machine. The store is written back only
after a message was handled successfully.
This module reads and writes the bytes only (no torch), so the ClientApp process that forwards a
message to a warm worker (`hf_fedtask.engine.flower.worker`) stays light.
"""

from __future__ import annotations

import secrets

from flwr.app import ConfigRecord, Context

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


def store_bytes(context: Context) -> bytes | None:
    """The client's packed private store (None before its first message)."""
    record = context.state.array_records.get(STORE)
    if record is None or PAYLOAD not in record:
        return None
    return read_payload(context.state, source=f"node {context.node_id}'s client store", key=STORE)


def keep_store(context: Context, data: bytes) -> None:
    """Write the client's packed store back into the node's state."""
    context.state[STORE] = payload_record(data)


def load_store(context: Context):
    """The client's private store, unpacked (empty on its first message)."""
    from hf_fedtask.engine.flower.handler import unpack_store

    return unpack_store(store_bytes(context), source=f"node {context.node_id}'s client store")
