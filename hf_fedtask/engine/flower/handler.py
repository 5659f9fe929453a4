"""The client half of the Flower engine: one forwarded message answered with `ClientRuntime`, the
client every engine uses, on this process's environment (built once per run config and kept: a
worker or a simulation's long-lived process serves many messages with it).

A ClientApp without a worker calls `handle` in its own process; `hf-fedtask flower worker` calls it
for the ClientApps that forward to it (`hf_fedtask.engine.flower.worker`)."""

from __future__ import annotations

import functools

from hf_fedtask.core.state import ClientStore
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import pack_vectors, unpack_vectors
from hf_fedtask.engine.client import ClientRuntime
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.flower.request import ClientRequest, ClientResult
from hf_fedtask.engine.flower.settings import AppSettings, parse_run_config


@functools.lru_cache(maxsize=1)
def environment(config_json: str) -> Environment:
    """The run's environment in this process, built once per config."""
    return Environment(parse_run_config(config_json))


def unpack_store(data: bytes | None, source: str) -> ClientStore:
    """A client's packed private store (None: its first message, an empty store)."""
    return {} if data is None else unpack_vectors(TaskVector.from_bytes(data, source=source))


def handle(request: ClientRequest) -> ClientResult:
    """Answer one instruction as client `request.client`; the store is returned updated."""
    settings = AppSettings.from_run_config(request.run_config)
    runtime = ClientRuntime(environment(settings.config), request.client, secagg_secret=request.secret)
    store = unpack_store(request.store, source=f"client {request.client}'s store")
    reply = runtime.handle(request.instruction, store)
    return ClientResult(reply, pack_vectors(store).to_bytes())
