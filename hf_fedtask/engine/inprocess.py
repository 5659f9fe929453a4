"""The in-process engine, to step by hand: one environment (one host model), the server half and the
in-process transport, with the round exposed (notebooks, tests, custom loops)."""

from __future__ import annotations

from datasets import Dataset

from hf_fedtask.config import RunConfig
from hf_fedtask.core.state import GlobalState
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.server import Server
from hf_fedtask.engine.transport import InProcessTransport


class Federation:
    """`Federation(config).run_round(state, r)` is one round of `hf_fedtask.engine.run.run`, without
    its folder, checkpoints or logs."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.env = Environment(config)
        self.server = Server(self.env)
        self.server.check()
        self.transport = InProcessTransport(self.env)

    def run_round(self, state: GlobalState, round_: int) -> tuple[GlobalState, dict]:
        return self.server.round(state, round_, self.transport)

    def evaluate(self, state: GlobalState) -> dict[str, dict]:
        return self.server.evaluate(state, self.transport, self.transport.stores)

    def initial_state(self) -> GlobalState:
        return self.env.initial_state()

    def client_data(self, client_id: int) -> dict[str, Dataset]:
        return self.env.client_data(client_id)

    def test_data(self, task: str) -> Dataset:
        return self.env.test_data(task)

    def header(self) -> dict:
        return self.env.header()

    @property
    def strategy(self):
        return self.env.strategy

    @property
    def host(self):
        return self.env.host

    @property
    def trainer(self):
        return self.env.trainer

    @property
    def tasks(self):
        return self.env.tasks

    @property
    def allocation(self) -> dict[int, list[str]]:
        return self.env.allocation

    @property
    def origin(self):
        return self.env.origin

    @property
    def initial_heads(self):
        return self.env.initial_heads

    @property
    def client_stores(self):
        return self.transport.stores
