"""Error classes users can catch: every error class of hf_fedtask is defined here. Every message is
one line that names the file, key, client or name at fault; the CLI prints it and exits 2 without
touching existing outputs."""


class FedTaskError(Exception):
    """Base class of every error hf_fedtask raises on bad input."""


class TaskVectorError(FedTaskError):
    """A task-vector file is unreadable, corrupt, or does not match the expected template
    (keys, shapes, dtypes, finite values, base model or PEFT config)."""


class ConfigError(FedTaskError):
    """A run configuration is invalid: unknown strategy/suite/task name, bad value, conflicting keys."""


class DataError(FedTaskError):
    """A task or partition cannot be built (unknown task, missing column, too few samples)."""


class OutputDirError(FedTaskError):
    """The output directory already holds a different run."""


class HubError(FedTaskError):
    """Publishing to the Hub failed (network, authentication, repository)."""


class ProtocolError(FedTaskError):
    """A federated message broke the protocol: it arrived for another client, round, phase or run,
    out of order, of a kind its receiver does not handle, or without the parts it must carry."""


class SecAggError(ProtocolError, ValueError):
    """Secure aggregation (`hf_fedtask.core.secagg`) refused an input: bad upload, overflow, late or
    unknown client, too few survivors. A `ValueError` too, as it flags bad input."""


class LinearizationError(FedTaskError, ValueError):
    """The model cannot be linearized (`hf_fedtask.model.linearize`): no trainable parameters, or an op
    without forward-mode AD."""


class WorkerError(FedTaskError):
    """A SuperNode's warm client worker (`hf-fedtask flower worker`) is unreachable, already running,
    or failed to answer a message."""


class UntrustedUpload(ProtocolError):
    """A client's reply failed a check at the server's trust boundary (`hf_fedtask.engine.trust`): its
    header names another client or round, tasks or sample counts it does not hold, malformed metrics, or
    tensors that do not match what the server expects of it. `client`, `round` and `field` name the fault."""

    def __init__(self, client: int, round: int, field: str, message: str):
        super().__init__(f"client {client}, round {round}: {message}")
        self.client, self.round, self.field = client, round, field
