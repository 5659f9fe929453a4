"""The Flower engine: the shared round loop with its clients in Flower SuperNodes.

    run(config, engine=grid_engine(grid))      # inside a ServerApp (what `app.server_app` does)
    launch(config, "my-superlink")             # from outside: `flwr run` + a status check
    run(config, engine=local_grid_engine())    # debugging: the real apps through Flower messages, one process

`transport.GridTransport` carries instructions as Flower Messages, `discovery` maps the run's client
ids to node ids, `app` holds the ServerApp and ClientApp, `handler` the client half they run, `worker`
the warm worker a SuperNode's ClientApp may forward to (`request` what it forwards), `node` the
client's state on its node, `records` the message layout, `settings` and `manifest` the app's run
config and pyproject.toml, `local` the in-process Flower Grid (no Ray, no sockets; the only module
touching Flower internals).
Needs the `flower` extra: pip install "hf-fedtask[flower]".

The names below are imported on first use, so that a ClientApp process (which imports `app`) loads
no torch.
"""

from hf_fedtask.core.lazy import lazy_attributes

_LAZY = {
    "discover_clients": "discovery",
    "launch": "launch",
    "InProcessGrid": "local",
    "local_grid_engine": "local",
    "AppSettings": "settings",
    "GridTransport": "transport",
    "grid_engine": "transport",
}
__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
