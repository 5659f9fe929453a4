"""The Flower engine: the shared round loop with its clients in Flower SuperNodes.

    run(config, engine=grid_engine(grid))      # inside a ServerApp (what `app.server_app` does)
    launch(config, "my-superlink")             # from outside: `flwr run` + a status check
    run(config, engine=local_grid_engine())    # debugging: the real apps through Flower messages, one process

`transport.GridTransport` carries instructions as Flower Messages, `discovery` maps the run's client
ids to node ids, `app` holds the ServerApp and ClientApp, `node` the client's state on its node,
`records` the message layout, `settings` and `manifest` the app's run config and pyproject.toml,
`local` the in-process Flower Grid (no Ray, no sockets; the only module touching Flower internals).
Needs the `flower` extra: pip install "hf-fedtask[flower]".
"""

from hf_fedtask.engine.flower.discovery import discover_clients
from hf_fedtask.engine.flower.launch import launch
from hf_fedtask.engine.flower.local import InProcessGrid, local_grid_engine
from hf_fedtask.engine.flower.settings import AppSettings
from hf_fedtask.engine.flower.transport import GridTransport, grid_engine

__all__ = ["AppSettings", "GridTransport", "InProcessGrid", "discover_clients", "grid_engine", "launch",
           "local_grid_engine"]
