"""Error classes users can catch. Every message is one line that names the file, key, client or
name at fault; the CLI prints it and exits non-zero without touching existing outputs."""


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
