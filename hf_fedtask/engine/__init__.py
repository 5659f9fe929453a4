"""Engines: one round loop (`server.Server.round`, driven by `run.run`) and the transports that carry
its instructions to clients: in-process (`transport.InProcessTransport`, `inprocess.Federation`) or
Flower (`engine.flower`). Import what you need from the submodules (`from hf_fedtask.engine.run import run`)."""
