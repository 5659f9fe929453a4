"""The Flower ServerApp and ClientApp of hf_fedtask.

`server_app` reads the whole RunConfig from the run config (`AppSettings`) and drives the same
`hf_fedtask.engine.run.run` as every engine, with a `GridTransport`: metrics.jsonl, checkpoints,
validation of uploads and byte accounting are those of the in-process engine.

`client_app` answers each instruction with `ClientRuntime`, the client half every engine uses, as
client `partition-id` of the run. The ClientApp raises on failure, so Flower returns an error reply
that the server records as that client's failure.
"""

from __future__ import annotations

import functools
from logging import INFO

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from hf_fedtask.engine.client import ClientRuntime
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.flower.discovery import discovery_reply, partition_id
from hf_fedtask.engine.flower.node import load_store, node_secret, save_store
from hf_fedtask.engine.flower.records import (
    MESSAGE_TYPES,
    read_instruction,
    reply_content,
)
from hf_fedtask.engine.flower.settings import AppSettings, parse_run_config
from hf_fedtask.engine.flower.transport import grid_engine
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ProtocolError

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federated job described by the run config on this federation's SuperNodes."""
    settings = AppSettings.from_run_config(context.run_config)
    config = settings.run_config()
    results = run(config, resume=settings.resume, overwrite=settings.overwrite,
                  engine=grid_engine(grid, timeout=settings.exchange_timeout, wait=settings.wait))
    log(INFO, "hf_fedtask run finished in %s: mean_metric %.4f", config.output_dir, results["mean_metric"])


@functools.lru_cache(maxsize=1)
def environment(config_json: str) -> Environment:
    """The run's environment in this process, built once per config (a simulation's long-lived
    worker serves many messages; a deployment's ClientApp process serves one)."""
    return Environment(parse_run_config(config_json))


def answer(message: Message, context: Context) -> Message:
    """Handle one train / query / evaluate instruction as client `partition-id`."""
    client = partition_id(context)
    source = f"message to client {client}"
    ins = read_instruction(message.content, source)
    if MESSAGE_TYPES[ins.kind] != message.metadata.message_type:
        raise ProtocolError(f"{source}: a {ins.kind} instruction arrived as a {message.metadata.message_type} message")
    settings = AppSettings.from_run_config(context.run_config)
    runtime = ClientRuntime(environment(settings.config), client, secagg_secret=node_secret(context))
    store = load_store(context)
    reply = runtime.handle(ins, store)
    save_store(context, store)
    return Message(reply_content(reply), reply_to=message)


client_app.train()(answer)
client_app.evaluate()(answer)
client_app.query()(answer)
client_app.query("discover")(discovery_reply)
