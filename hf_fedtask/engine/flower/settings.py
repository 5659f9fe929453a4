"""The Flower app's run-config keys: the whole `RunConfig` as ONE JSON string, plus how to start it.

Flower's run config is a flat map of scalars whose keys must be declared in the app manifest, so the
run's config travels as a single JSON string (`config`) beside a few engine settings. The same
declaration feeds the manifest (`manifest.py`), the ServerApp that reads it and the launcher that
writes the overrides, so the three cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hf_fedtask.config import RunConfig
from hf_fedtask.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppSettings:
    """What `flwr run ... --run-config` carries. `timeout`: seconds to wait for one exchange's replies
    (0: until every client answered or its node is reported lost); `wait`: seconds to wait for the
    SuperNodes to connect before the run starts."""

    config: str = "{}"  # RunConfig.to_dict() as JSON
    resume: bool = False
    overwrite: bool = False
    timeout: float = 0.0
    wait: float = 60.0

    @classmethod
    def defaults(cls) -> dict:
        """The manifest's `[tool.flwr.app.config]` table."""
        return dataclasses.asdict(cls())

    @classmethod
    def from_run_config(cls, run_config: Mapping) -> AppSettings:
        """Read Flower's `context.run_config` (unknown keys are refused: they are typos)."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            raise ConfigError(f"Flower run config: unknown key {unknown[0]!r}; the app reads {', '.join(known)}")
        values = {}
        for name, value in run_config.items():
            kind = type(known[name].default)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ConfigError(f"Flower run config: {name} must be a {kind.__name__}, got {value!r}")
            values[name] = value
        settings = cls(**values)
        if settings.timeout < 0 or settings.wait < 0:
            raise ConfigError("Flower run config: timeout and wait must be >= 0")
        return settings

    @classmethod
    def for_run(cls, config: RunConfig, **settings) -> AppSettings:
        return cls(config=json.dumps(config.to_dict(), sort_keys=True), **settings)

    def to_run_config(self) -> dict:
        """The `--run-config` overrides (a TOML table)."""
        return dataclasses.asdict(self)

    def run_config(self) -> RunConfig:
        """The run's config, with `output_dir` absolute: a ServerApp's working directory is the
        SuperLink's, not the caller's, so a relative folder is resolved here and logged."""
        config = parse_run_config(self.config)
        out = Path(config.output_dir).expanduser()
        if not out.is_absolute():
            out = out.resolve()
            logger.warning("output_dir %r is relative: writing the run to %s", config.output_dir, out)
        return dataclasses.replace(config, output_dir=str(out))

    @property
    def exchange_timeout(self) -> float | None:
        return self.timeout or None


def parse_run_config(config_json: str) -> RunConfig:
    """The RunConfig in the run config's `config` key (an empty one is refused, not defaulted)."""
    try:
        d = json.loads(config_json)
    except ValueError as e:
        raise ConfigError(f"Flower run config: config is not valid JSON ({e})") from None
    if not isinstance(d, dict) or not d:
        raise ConfigError("Flower run config: config holds no RunConfig; pass RunConfig.to_dict() as JSON, "
                          "e.g. with hf_fedtask.engine.flower.launch.launch")
    return RunConfig.from_dict(d, source="Flower run config")
