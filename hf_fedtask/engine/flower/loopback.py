"""A Flower federation on this machine's loopback, for tests, benchmarks and trying a deployment: a
SuperLink (a Ray simulation one with `simulation=True`) and, for a deployment, one SuperNode per
client with `partition-id` 0..N-1, each in its own process group on a free port, under a private
FLWR_HOME, stopped by PID (SIGTERM to each group, SIGKILL after 15 s).

    with LoopbackFederation(workdir, num_nodes=4) as fed:
        fed.launch(config)                       # hf_fedtask.engine.flower.launch on its connection
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_env(home: Path) -> dict:
    """The environment of Flower processes: a private FLWR_HOME, offline, no telemetry, this venv's tools
    (and this process's OMP_NUM_THREADS / MKL_NUM_THREADS, if set)."""
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


class Processes:
    """Processes started in their own process groups, stopped by PID (SIGTERM to each group)."""

    def __init__(self, env: dict, logs: Path):
        self.env, self.logs, self.procs = env, logs, []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        exe = str(Path(sys.executable).with_name(args[0]))
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen([exe, *args[1:]], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=self.logs)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []

    def tail(self) -> str:
        logs = sorted(self.logs.glob("*.log"))
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in logs)


def wait_healthy(port: int, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the SuperLink exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"no SuperLink on port {port} after {seconds} s")


class LoopbackFederation:
    """A SuperLink on 127.0.0.1 (a Ray simulation one with `simulation=True`) and, for a deployment,
    one SuperNode per client with `partition-id` 0..N-1, under a temporary FLWR_HOME. `connection`:
    the name to give `launch`; `startup_s`: seconds until the SuperLink answered its health check."""

    def __init__(self, workdir: Path, num_nodes: int, *, simulation: bool = False, num_partitions: int | None = None):
        self.home = workdir / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.num_nodes, self.simulation = num_nodes, simulation
        self.num_partitions = num_nodes if num_partitions is None else num_partitions  # fewer nodes: a broken one
        self.procs = Processes(flower_env(self.home), workdir / "logs")
        self.port = free_port()
        self.connection = "loopback"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n'
            "insecure = true\n")
        self.startup_s = None

    def __enter__(self) -> LoopbackFederation:
        start = time.monotonic()
        try:
            args = ["flower-superlink", "--insecure", *(["--simulation"] if self.simulation else []), "--host",
                    "127.0.0.1", "--port", str(self.port), "--disable-runtime-dependency-installation"]
            link = self.procs.start("superlink", *args)
            wait_healthy(self.port, link)
            if not self.simulation:
                for i in range(self.num_nodes):
                    self.procs.start(f"supernode-{i}", "flower-supernode", "--insecure", "--superlink",
                                     f"127.0.0.1:{self.port}", "--port", str(free_port()), "--node-config",
                                     f"partition-id={i} num-partitions={self.num_partitions}")
        except BaseException:
            print(self.procs.tail(), file=sys.stderr)  # the processes' own logs say why
            self.procs.stop()
            raise
        self.startup_s = time.monotonic() - start
        return self

    def launch(self, config, *, app_dir: Path | None = None, wait: float = 180.0) -> None:
        from hf_fedtask.engine.flower.launch import launch

        federation = {"num-supernodes": self.num_nodes} if self.simulation else None
        try:
            launch(config, self.connection, app_dir=app_dir, wait=wait, flwr_home=self.home, echo=None,
                   federation_config=federation)
        except BaseException:
            print(self.procs.tail(), file=sys.stderr)  # the processes' own logs say why
            raise

    def __exit__(self, *exc) -> None:
        self.procs.stop()
