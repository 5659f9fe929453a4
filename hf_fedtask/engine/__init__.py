"""Engines: one round loop (`server.Server.round`, driven by `run.run`) and the transports that carry
its instructions to clients: in-process (`transport.InProcessTransport`) or Flower (`engine.flower`)."""

from hf_fedtask.engine.inprocess import Federation
from hf_fedtask.engine.run import open_finished_run, run

__all__ = ["Federation", "open_finished_run", "run"]
