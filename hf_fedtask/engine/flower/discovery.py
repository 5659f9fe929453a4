"""Which SuperNode holds which client: one QUERY round answered from each node's `partition-id`.

Flower gives nodes random 64-bit ids; the run's clients are 0..N-1. Each SuperNode is started with
`--node-config "partition-id=<i> num-partitions=<N>"` (a simulation numbers its nodes the same way),
and the ClientApp answers the `query.discover` message with that id. A federation that does not hold
each of the run's clients exactly once is refused before anything is written.
"""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid

from hf_fedtask.engine.flower.records import DISCOVER
from hf_fedtask.errors import FedTaskError

PARTITION_ID = "partition-id"
NODE = "node"  # the ConfigRecord of a discovery reply


def partition_id(context: Context) -> int:
    """The client id this node holds, from its node config."""
    value = context.node_config.get(PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FedTaskError(f"node {context.node_id} has no integer {PARTITION_ID} in its node config "
                           f"(got {value!r}); start it with --node-config \"{PARTITION_ID}=<i> num-partitions=<N>\"")
    return value


def discovery_reply(message: Message, context: Context) -> Message:
    """The ClientApp's answer to a discovery query."""
    return Message(RecordDict({NODE: ConfigRecord({PARTITION_ID: partition_id(context)})}), reply_to=message)


def _hint(num_clients: int) -> str:
    return (f"start {num_clients} SuperNodes with --node-config \"{PARTITION_ID}=<0..{num_clients - 1}> "
            f"num-partitions={num_clients}\" (simulation: flwr run --federation-config num-supernodes={num_clients})")


def wait_for_nodes(grid: Grid, num_clients: int, wait: float, poll: float = 1.0) -> list[int]:
    """The node ids once `num_clients` nodes are connected (polling for up to `wait` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) > num_clients:
            raise FedTaskError(f"the federation has {len(nodes)} nodes but this run has {num_clients} clients: "
                               + _hint(num_clients))
        if len(nodes) == num_clients:
            return nodes
        if time.monotonic() >= deadline:
            raise FedTaskError(f"the federation has {len(nodes)} nodes after waiting {wait:g} s but this run has "
                               f"{num_clients} clients: " + _hint(num_clients))
        time.sleep(poll)


def discover_clients(grid: Grid, num_clients: int, *, timeout: float | None = None,
                     wait: float = 60.0) -> dict[int, int]:
    """{client id: node id} for a federation holding clients 0..num_clients-1, each exactly once."""
    nodes = wait_for_nodes(grid, num_clients, wait)
    messages = [Message(RecordDict(), dst_node_id=node, message_type=DISCOVER) for node in nodes]
    node_of: dict[int, int] = {}
    answered = set()
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = reply.metadata.src_node_id
        answered.add(node)
        if reply.has_error():
            reason = " ".join((reply.error.reason or "no reason given").split())
            raise FedTaskError(f"node {node} could not tell which client it holds (Flower error "
                               f"{reply.error.code}: {reason})")
        record = reply.content.config_records.get(NODE)
        client = record.get(PARTITION_ID) if record is not None else None
        if not isinstance(client, int) or not 0 <= client < num_clients:
            raise FedTaskError(f"node {node} holds {PARTITION_ID} {client!r}, outside this run's clients "
                               f"0..{num_clients - 1}: " + _hint(num_clients))
        if client in node_of:
            raise FedTaskError(f"nodes {node_of[client]} and {node} both hold {PARTITION_ID} {client}: "
                               + _hint(num_clients))
        node_of[client] = node
    missing = [n for n in nodes if n not in answered]
    if missing:
        raise FedTaskError(f"node {missing[0]} did not answer the discovery query"
                           + (f" within {timeout:g} s" if timeout else ""))
    return node_of
