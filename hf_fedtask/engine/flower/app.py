"""The Flower ServerApp and ClientApp of hf_fedtask.

`server_app` reads the whole RunConfig from the run config (`AppSettings`) and drives the same
`hf_fedtask.engine.run.run` as every engine, with a `GridTransport`: metrics.jsonl, checkpoints,
validation of uploads and byte accounting are those of the in-process engine.

`client_app` answers each instruction as client `partition-id` of the run. On a SuperNode started with
a warm worker (`--node-config "... worker='PATH'"`, `hf_fedtask.engine.flower.worker`) it only forwards
the instruction and the node's state to it, once the worker proved it holds the key beside its socket
(`PATH.key`, or `worker-key='KEY'`); otherwise it answers in its own process
(`hf_fedtask.engine.flower.handler`). This module imports no torch: Flower starts a ClientApp process
per message, and one that forwards should cost no more than Flower itself. The ClientApp raises on
failure, so Flower returns an error reply that the server records as that client's failure.
"""

from __future__ import annotations

from logging import INFO

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from hf_fedtask.engine.flower.discovery import discovery_reply, partition_id
from hf_fedtask.engine.flower.node import keep_store, node_secret, store_bytes
from hf_fedtask.engine.flower.records import MESSAGE_TYPES, read_instruction, reply_content
from hf_fedtask.engine.flower.request import ClientRequest, ClientResult
from hf_fedtask.engine.flower.worker import forward, worker_address, worker_key_file
from hf_fedtask.errors import ProtocolError

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federated job described by the run config on this federation's SuperNodes."""
    from hf_fedtask.engine.flower.settings import AppSettings
    from hf_fedtask.engine.flower.transport import grid_engine
    from hf_fedtask.engine.run import run

    settings = AppSettings.from_run_config(context.run_config)
    config = settings.run_config()
    results = run(config, resume=settings.resume, overwrite=settings.overwrite,
                  engine=grid_engine(grid, timeout=settings.exchange_timeout, wait=settings.wait))
    log(INFO, "hf_fedtask run finished in %s: mean_metric %.4f", config.output_dir, results["mean_metric"])


def answer(message: Message, context: Context) -> Message:
    """Handle one train / query / evaluate instruction as client `partition-id`."""
    client = partition_id(context)
    source = f"message to client {client}"
    ins = read_instruction(message.content, source)
    if MESSAGE_TYPES[ins.kind] != message.metadata.message_type:
        raise ProtocolError(f"{source}: a {ins.kind} instruction arrived as a {message.metadata.message_type} message")
    request = ClientRequest(dict(context.run_config), client, node_secret(context), ins, store_bytes(context))
    address = worker_address(context.node_config)
    if address:  # only once the worker proved it holds its key (PATH.key, or worker-key='KEY')
        result = forward(address, request, worker_key_file(context.node_config, address))
    else:
        result = _handle_here(request)
    keep_store(context, result.store)
    return Message(reply_content(result.reply), reply_to=message)


def _handle_here(request: ClientRequest) -> ClientResult:
    from hf_fedtask.engine.flower.handler import handle

    return handle(request)


client_app.train()(answer)
client_app.evaluate()(answer)
client_app.query()(answer)
client_app.query("discover")(discovery_reply)
