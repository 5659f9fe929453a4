"""Start a run on a Flower SuperLink with `flwr run ... --stream`, and tell whether it succeeded.

`flwr run --stream` exits 0 even when the ServerApp raised, so after the stream ends the run's
status is read back with `flwr ls CONNECTION --run-id ID --format json`; anything but
`finished:completed` is a `FedTaskError`. The RunConfig goes as one JSON string in a TOML file
passed to `--run-config` (a file needs no shell quoting of the JSON).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import tomli_w

from hf_fedtask.config import RunConfig
from hf_fedtask.engine.flower.manifest import write_app_dir
from hf_fedtask.engine.flower.settings import AppSettings
from hf_fedtask.errors import FedTaskError

COMPLETED = "finished:completed"
_STARTED = re.compile(r"Successfully started run (\d+)")


def flwr_executable() -> str:
    """The `flwr` CLI of this Python environment (else the one on PATH)."""
    beside = Path(sys.executable).with_name("flwr")
    found = str(beside) if beside.exists() else shutil.which("flwr")
    if not found:
        raise FedTaskError('the flwr command is not installed: pip install "hf-fedtask[flower]"')
    return found


def launch(config: RunConfig, connection: str, *, app_dir: str | Path | None = None, resume: bool = False,
           overwrite: bool = False, timeout: float | None = None, wait: float = 60.0,
           federation_config: Mapping[str, bool | int | float | str] | None = None,
           flwr_home: str | Path | None = None, echo: Callable[[str], None] | None = print,
           status_wait: float = 60.0) -> str:
    """Run `config` on the SuperLink named `connection` (in `$FLWR_HOME/config.toml`) and return the
    Flower run id once it finished successfully; a `FedTaskError` otherwise.

    `app_dir`: the Flower app folder (default: the manifest written to a temporary folder);
    `timeout`, `wait`: see `AppSettings`; `federation_config`: `--federation-config` values, e.g.
    `{"num-supernodes": 4}` for a simulation SuperLink (one SuperNode per client); `flwr_home`: the
    Flower home holding the connection (default: `$FLWR_HOME` or `~/.flwr`); `echo`: receives each
    line `flwr run` prints (None: quiet); `status_wait`: seconds to wait for the run to be reported
    finished once its log stream ended. `output_dir` is made absolute here, since the ServerApp runs
    in the SuperLink's working directory."""
    config = dataclasses.replace(config, output_dir=str(Path(config.output_dir).expanduser().resolve()))
    settings = AppSettings.for_run(config, resume=resume, overwrite=overwrite, timeout=float(timeout or 0.0),
                                   wait=float(wait))
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": os.environ.get("FLWR_TELEMETRY_ENABLED", "0"),
           "COLUMNS": "400"}  # rich wraps (and splits words) at 80 columns when piped
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    flwr = flwr_executable()
    with tempfile.TemporaryDirectory(prefix="hf_fedtask_flower_") as tmp:
        app = Path(app_dir) if app_dir is not None else write_app_dir(Path(tmp) / "hf-fedtask-flower")
        overrides = Path(tmp) / "run_config.toml"
        overrides.write_text(tomli_w.dumps(settings.to_run_config()))
        cmd = [flwr, "run", str(app), connection, "--run-config", str(overrides), "--stream"]
        for key, value in (federation_config or {}).items():
            cmd += ["--federation-config", f"{key}={_toml_value(value)}"]
        lines = _stream(cmd, env, echo)
    run_id = next((m.group(1) for line in lines if (m := _STARTED.search(line))), None)
    if run_id is None:
        raise FedTaskError(f"flwr run did not start a run on {connection!r}: {_last_words(lines)}")
    status, details = _wait_finished(flwr, connection, run_id, env, status_wait)
    if status != COMPLETED:
        raise FedTaskError(f"Flower run {run_id} on {connection!r} ended {status}"
                           + (f" ({' '.join(details.split())})" if details else "")
                           + f"; its log: flwr log {run_id} {connection} --show")
    return run_id


def run_status(connection: str, run_id: str, *, flwr_home: str | Path | None = None) -> tuple[str, str]:
    """(status, details) of Flower run `run_id`, e.g. ("finished:completed", "")."""
    env = {**os.environ}
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return _status(flwr_executable(), connection, run_id, env)


def _stream(cmd: list[str], env: dict, echo: Callable[[str], None] | None) -> list[str]:
    """Run `cmd`, passing each output line to `echo`; its lines (a non-zero exit is a FedTaskError)."""
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if echo is not None:
                echo(line)
    if proc.returncode != 0:
        raise FedTaskError(f"{Path(cmd[0]).name} {cmd[1]} exited with status {proc.returncode}: {_last_words(lines)}")
    return lines


def _status(flwr: str, connection: str, run_id: str, env: dict) -> tuple[str, str]:
    proc = subprocess.run([flwr, "ls", connection, "--run-id", run_id, "--format", "json"], env=env,
                          capture_output=True, text=True, errors="replace", check=False)
    try:
        start = proc.stdout.index("{")
        report, _ = json.JSONDecoder().raw_decode(proc.stdout[start:])
    except ValueError:
        raise FedTaskError(f"flwr ls {connection} gave no JSON (exit {proc.returncode}): "
                           f"{_last_words((proc.stdout + proc.stderr).splitlines())}") from None
    if not report.get("success"):
        raise FedTaskError(f"flwr ls {connection} failed: {' '.join(str(report.get('error-message')).split())}")
    runs = [r for r in report.get("runs", []) if r.get("run-id") == run_id]
    if not runs:
        raise FedTaskError(f"flwr ls {connection} does not list run {run_id}")
    return runs[0].get("status", ""), runs[0].get("status-details", "")


def _wait_finished(flwr: str, connection: str, run_id: str, env: dict, wait: float) -> tuple[str, str]:
    """The run's final status: its log stream may end a moment before the SuperLink marks it finished."""
    deadline = time.monotonic() + wait
    while True:
        status, details = _status(flwr, connection, run_id, env)
        if status.startswith("finished") or time.monotonic() >= deadline:
            return status, details
        time.sleep(1.0)


def _toml_value(value) -> str:
    return tomli_w.dumps({"v": value}).partition("=")[2].strip()


def _last_words(lines: list[str]) -> str:
    """The last message of a CLI's output as one line: the last box `rich` draws around errors (its
    frame removed), else the last three lines."""
    boxes = [i for i, line in enumerate(lines) if line.lstrip().startswith("╭")]
    tail = lines[boxes[-1]:] if boxes else lines
    text = [stripped for line in tail if (stripped := line.strip(" \t│╭╮╰╯─┃━┏┓┗┛"))]
    return " ".join(text if boxes else text[-3:]) if text else "no output"
