"""The in-process Flower Grid: a Flower app debugged in one process.

The real server logic (`hf_fedtask.engine.run.run` with a `GridTransport`, discovery of which node
holds which client) and the real ClientApp (`hf_fedtask.engine.flower.app.client_app`), with every
message and every node's state passed through Flower's own serialization, as between processes, but
no Ray, no sockets and no SuperLink: a breakpoint in a ClientApp handler stops in this process.

    engine = local_grid_engine()                 # one node per client of the run
    run(config, engine=engine)                   # hf_fedtask.engine.run.run, as with any engine
    engine.grid.stores()                         # what each node kept for its client

    grid = InProcessGrid(client_app, AppSettings.for_run(config, wait=0.0).to_run_config(), 4)
    run_server_app(grid)                         # the ServerApp's own `main`, reading the run config

Messages are delivered at once and one after another (a client's training blocks the exchange), so
it shows what the Flower layer costs on top of the in-process engine, not how a federation scales.
Replies come back in reverse order (a server must match them by sender, as it must on a real
SuperLink); an exception in the ClientApp becomes an error reply and leaves the node's state
unchanged, as Flower's SuperNode runtime does; `timeout` is ignored since nothing is ever late.

Flower 1.41 has no public in-process Grid (its simulation needs Ray, its deployment a SuperLink), so
this module touches a few Flower internals, and only this module does:

* `flwr.supercore.task_identity.TaskIdentity`: `Message(...)` reads the sender's run, node and task
  ids from this process-wide class, which Flower's runtimes set in each ServerApp / ClientApp
  process. Here the grid sets the ServerApp's identity when it is built (so the server's messages
  name this run and the SuperLink's node id) and the destination node's while a ClientApp handles a
  message.
* `flwr.supercore.run.Run.create_empty`: the `Run` a grid reports as `grid.run`.
* `flwr.common.constant.SUPERLINK_NODE_ID`, `flwr.common.constant.ErrorCode`: the server's node id,
  and the error code of a reply to a message whose ClientApp raised.
* `flwr.common.serde.context_to_proto` / `context_from_proto` (with `flwr.proto.message_pb2.Context`):
  each node's `Context` (its `state` included) is kept as protobuf bytes between messages, as a
  SuperNode keeps it, so state that would not survive a real SuperNode does not survive here.
* `flwr.supercore.inflatable.inflatable_object.get_all_nested_objects`,
  `flwr.supercore.inflatable.inflatable_utils.inflate_object_from_contents`: a message is deflated
  into the objects Flower transfers and inflated again, in both directions.
* `Metadata.__dict__["_message_id"]`: a message is named by its object id, as Flower's grids do.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from hf_fedtask.core.state import ClientStore
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.flower.discovery import PARTITION_ID
from hf_fedtask.engine.flower.node import load_store
from hf_fedtask.engine.flower.settings import AppSettings
from hf_fedtask.engine.flower.transport import GridTransport, grid_engine

logger = logging.getLogger(__name__)

RUN_ID = 4242
"""The Flower run id of an in-process grid (there is no SuperLink to assign one)."""

ClientAppLike = Callable[[Message, Context], Message]


class InProcessGrid(Grid):
    """A Grid whose nodes are `Context`s in this process: a message is handed to `app` (a ClientApp)
    at once, after a round trip through Flower's serialization, and so is its reply.

    `run_config`: every node's `context.run_config` (hf_fedtask's app reads `AppSettings` from it);
    `num_nodes`: how many nodes (random 63-bit node ids, seeded); `partition_ids`: each node's
    `partition-id` (default 0..num_nodes-1; anything, to test how a federation that does not hold
    each client once is refused); `silent`: partition ids whose replies to train messages are lost
    (a node that dropped out); `run_id`: the Flower run id; `node_config`: further node-config values of
    every node (e.g. `{"worker": path}`: its ClientApp forwards to that warm worker)."""

    def __init__(self, app: ClientAppLike, run_config: dict, num_nodes: int, *, partition_ids: list | None = None,
                 silent: Iterable[int] = (), run_id: int = RUN_ID, node_config: dict | None = None):
        _set_identity(run_id, SUPERLINK_NODE_ID)
        self.app = app
        self.run_config = dict(run_config)
        self._run = Run.create_empty(run_id)
        self.silent = set(silent)
        self.rng = random.Random(0)
        ids = partition_ids if partition_ids is not None else list(range(num_nodes))
        self.contexts: dict[int, bytes] = {}  # node id -> its Context as protobuf bytes
        for pid in ids:
            node = self.rng.getrandbits(63)
            context = Context(run_id, node, {PARTITION_ID: pid, "num-partitions": num_nodes, **(node_config or {})},
                              RecordDict(), dict(run_config))
            self.contexts[node] = context_to_proto(context).SerializeToString()
        self.message_types: list[str] = []  # every message type delivered, in order (tests, debugging)
        self._replies: dict[str, Message] = {}

    # -- the Grid interface -------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            message = over_the_wire(message)
            message.metadata.__dict__["_message_id"] = message.object_id  # as Flower's grids name messages
            self.message_types.append(message.metadata.message_type)
            node = message.metadata.dst_node_id
            context = self.context(node)
            reply = self._handle(message, context, node)
            ids.append(message.metadata.message_id)
            lost = message.metadata.message_type == "train" and context.node_config.get(PARTITION_ID) in self.silent
            if not lost:
                self._replies[message.metadata.message_id] = over_the_wire(reply)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        replies = [self._replies.pop(i) for i in message_ids if i in self._replies]
        return replies[::-1]  # not in the order sent: replies must be matched by their sender

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))

    # -- the nodes ----------------------------------------------------------------------------------
    def context(self, node: int) -> Context:
        """Node `node`'s Context as it stands (a fresh copy, read from its protobuf bytes)."""
        proto = ProtoContext()
        proto.ParseFromString(self.contexts[node])
        return context_from_proto(proto)

    def stores(self) -> dict[int, ClientStore]:
        """Every node's client store (what hf_fedtask's ClientApp keeps in its state), by partition id."""
        return {c.node_config[PARTITION_ID]: load_store(c) for c in map(self.context, self.contexts)}

    def _handle(self, message: Message, context: Context, node: int) -> Message:
        """The ClientApp's reply, with the node's state kept only when it succeeded."""
        server_identity = (TaskIdentity.run_id, TaskIdentity.node_id)
        _set_identity(context.run_id, node)
        try:
            reply = self.app(message, context)
            self.contexts[node] = context_to_proto(context).SerializeToString()
            return reply
        except Exception as e:  # noqa: BLE001  (Flower's runtime turns it into an error reply)
            logger.error("ClientApp of node %s raised an exception", node, exc_info=e)
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(e)}:<'{e}'>"), reply_to=message)
        finally:
            _set_identity(*server_identity)


def over_the_wire(message: Message) -> Message:
    """`message` deflated into the objects Flower transfers and inflated again (its metadata kept)."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    copy = inflate_object_from_contents(message.object_id, contents)
    copy.metadata.__dict__.update(message.metadata.__dict__)
    return copy


def _set_identity(run_id: int, node_id: int) -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, node_id, 1


def run_server_app(grid: InProcessGrid, app: ServerApp | None = None) -> None:
    """Run a ServerApp (default: hf_fedtask's) on `grid` with the grid's run config, as a SuperLink
    starts it: what `flwr run` does, in this process."""
    if app is None:
        from hf_fedtask.engine.flower.app import server_app as app
    app(grid, Context(grid.run.run_id, SUPERLINK_NODE_ID, {}, RecordDict(), dict(grid.run_config)))


class LocalGridEngine:
    """An engine for `hf_fedtask.engine.run.run` through an `InProcessGrid` holding hf_fedtask's
    ClientApp (or `app`); built by `local_grid_engine`. `grid`: the grid of the latest run (None
    before one), to look at the nodes' states or the message types delivered."""

    name = "flower-local"

    def __init__(self, num_clients: int | None = None, *, app: ClientAppLike | None = None,
                 partition_ids: list | None = None, silent: Iterable[int] = (), node_config: dict | None = None):
        self.num_clients = num_clients
        self.app = app
        self.partition_ids = partition_ids
        self.silent = set(silent)
        self.node_config = node_config
        self.grid: InProcessGrid | None = None

    def __call__(self, env: Environment) -> GridTransport:
        app = self.app
        if app is None:
            from hf_fedtask.engine.flower.app import client_app as app
        run_config = AppSettings.for_run(env.config, wait=0.0).to_run_config()
        self.grid = InProcessGrid(app, run_config, self.num_clients or env.num_clients,
                                  partition_ids=self.partition_ids, silent=self.silent, node_config=self.node_config)
        return grid_engine(self.grid, wait=0.0)(env)


def local_grid_engine(num_clients: int | None = None, *, app: ClientAppLike | None = None,
                      partition_ids: list | None = None, silent: Iterable[int] = (),
                      node_config: dict | None = None) -> LocalGridEngine:
    """The in-process Flower Grid as an engine: `run(config, engine=local_grid_engine())` runs the
    job with its clients behind Flower messages in this process. `num_clients`: how many nodes
    (default: one per client of the run); `app`: the ClientApp (default: hf_fedtask's);
    `partition_ids`, `silent`, `node_config`: see `InProcessGrid`."""
    return LocalGridEngine(num_clients, app=app, partition_ids=partition_ids, silent=silent, node_config=node_config)
