"""`GridTransport`: the shared round loop's instructions carried to Flower SuperNodes by a `Grid`.

One Message per instruction, to the node holding that client, with its own fresh RecordDict (a
RecordDict shared between messages would be one object for all of them). Replies may arrive in any
order and are keyed by the node that sent them; an error reply or a missing one is a failure the
round loop reports, exactly as for any other engine.
"""

from __future__ import annotations

import logging

from flwr.app import Message
from flwr.serverapp import Grid

from hf_fedtask.engine.flower.discovery import discover_clients
from hf_fedtask.engine.flower.records import (
    MESSAGE_TYPES,
    instruction_content,
    read_payload,
)
from hf_fedtask.engine.messages import Instruction
from hf_fedtask.engine.run import Engine
from hf_fedtask.engine.transport import Transport
from hf_fedtask.errors import FedTaskError

logger = logging.getLogger(__name__)


class GridTransport(Transport):
    """Delivers instructions through `grid`; `node_of`: client id -> the node id holding it;
    `timeout`: seconds to wait for one exchange's replies (None: until all have answered or
    their nodes are reported lost)."""

    name = "flower"

    def __init__(self, grid: Grid, node_of: dict[int, int], timeout: float | None = None):
        super().__init__()
        self.grid = grid
        self.node_of = dict(node_of)
        self.client_of = {node: client for client, node in self.node_of.items()}
        if len(self.client_of) != len(self.node_of):
            raise FedTaskError("Flower transport: two clients are mapped to the same node")
        self.timeout = timeout

    def exchange(self, instructions: list[Instruction]) -> dict[int, bytes]:
        clients = [ins.client_id for ins in instructions]
        if len(set(clients)) != len(clients):
            raise FedTaskError("Flower transport: one exchange holds two instructions for the same client")
        unknown = [c for c in clients if c not in self.node_of]
        if unknown:
            raise FedTaskError(f"Flower transport: no node holds client {unknown[0]}")
        messages = [Message(instruction_content(ins), dst_node_id=self.node_of[ins.client_id],
                            message_type=MESSAGE_TYPES[ins.kind], group_id=str(ins.round))
                    for ins in instructions]
        sent = set(clients)
        replies: dict[int, bytes] = {}
        failed: dict[int, str] = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.timeout):
            client = self.client_of.get(reply.metadata.src_node_id)
            if client not in sent or client in replies or client in failed:
                logger.warning("ignoring an unexpected reply from node %s", reply.metadata.src_node_id)
                continue
            if reply.has_error():
                failed[client] = f"Flower error {reply.error.code}: {_one_line(reply.error.reason)}"
                continue
            try:
                replies[client] = read_payload(reply.content, source=f"client {client}'s reply")
            except FedTaskError as e:
                failed[client] = str(e)
        for client in sorted(sent - set(replies) - set(failed)):
            failed[client] = f"no reply within {self.timeout:g} s" if self.timeout else "no reply"
        for client, why in sorted(failed.items()):
            logger.warning("client %s (node %s) failed: %s", client, self.node_of[client], why)
        for client in replies:
            self.failures.pop(client, None)  # `failures` holds each client's latest failure
        self.failures.update(failed)
        return replies


def grid_engine(grid: Grid, *, timeout: float | None = None, wait: float = 60.0) -> Engine:
    """An engine for `hf_fedtask.engine.run.run`: it learns which node holds which client (waiting up
    to `wait` seconds for them to connect), then carries every exchange through `grid`."""

    def engine(env) -> GridTransport:
        return GridTransport(grid, discover_clients(grid, env.num_clients, timeout=timeout, wait=wait), timeout)

    return engine


def _one_line(text: str | None, limit: int = 600) -> str:
    """A Flower error reason (possibly several lines) as one line."""
    line = " ".join((text or "").split()) or "no reason given"
    return line if len(line) <= limit else line[: limit - 3] + "..."
