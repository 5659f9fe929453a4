"""A Flower federation on this machine's loopback, for tests, benchmarks and trying a deployment: a
SuperLink (a Ray simulation one with `simulation=True`) and, for a deployment, one SuperNode per
client with `partition-id` 0..N-1, each in its own process group on a free port, under a private
FLWR_HOME, stopped by PID (SIGTERM to each group, SIGKILL after 15 s).

A deployment is secured as docs/tutorials/secured-deployment.md's is (`secure=True`, its default): credentials from
`hf_fedtask.engine.flower.credentials` in the workdir, a SuperLink with TLS and
`--enable-supernode-auth`, each node's public key registered with `flwr supernode register` before the
SuperNodes start with the CA and their private keys, and the connection in FLWR_HOME's config.toml
trusting the CA. `unregistered_nodes` / `anonymous_nodes` / `untrusting_nodes` start extra SuperNodes
that must be kept out: a valid key never registered; no key at all (a SuperNode then asks to register
itself, which `--enable-supernode-auth` refuses); or a registered key but another CA to trust.

`workers=True` starts a warm client worker (`hf-fedtask flower worker`, `hf_fedtask.engine.flower.worker`)
beside each of the run's SuperNodes, each on its own Unix socket in a short private folder, and tells the
SuperNode with `worker='PATH'` in its node config; `poll_interval` sets the SuperNodes'
FLWR_SUPEREXEC_TASK_POLL_INTERVAL (how often a SuperNode looks for a message to start a ClientApp for;
Flower's default 1 s).

    with LoopbackFederation(workdir, num_nodes=4) as fed:
        fed.launch(config)                       # hf_fedtask.engine.flower.launch on its connection
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
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


def wait_healthy(port: int, proc: subprocess.Popen, seconds: float = 180, *, ca: Path | None = None) -> None:
    """Poll the SuperLink's /health until it answers: over HTTPS trusting only `ca` when given."""
    url, context = f"http://127.0.0.1:{port}/health", None
    if ca is not None:
        url, context = f"https://127.0.0.1:{port}/health", ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the SuperLink exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context):
                return
        except ssl.SSLCertVerificationError:
            raise  # a SuperLink that is up but does not show the CA's certificate: no point waiting
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"no SuperLink on port {port} after {seconds} s")


class LoopbackFederation:
    """A SuperLink on 127.0.0.1 (a Ray simulation one with `simulation=True`) and, for a deployment,
    one SuperNode per client with `partition-id` 0..N-1, under a temporary FLWR_HOME. `connection`:
    the name to give `launch`; `startup_s`: seconds until the SuperLink answered its health check and
    the SuperNodes were started; `credentials`: the `Credentials` of a secured federation (else None);
    `extra`: {name: process} of the SuperNodes that must be kept out (`unregistered-J`, `anonymous-J`,
    `untrusting-J`, holding partition-ids past the run's, so that one let in would break the run);
    `log(name)`: a process's output so far.

    `secure` (default: a deployment is, a simulation is not): TLS, and for a deployment SuperNode
    authentication. `unregistered_nodes`: SuperNodes whose valid keys are never registered;
    `anonymous_nodes`: SuperNodes that trust the CA but have no key; `untrusting_nodes`: SuperNodes
    with registered keys that trust another CA. `workers`: a warm worker beside each of the run's
    SuperNodes, started with `worker_command` (default `hf-fedtask flower worker`) + `--socket PATH`;
    `poll_interval`: the SuperNodes' FLWR_SUPEREXEC_TASK_POLL_INTERVAL in seconds (None: Flower's)."""

    def __init__(self, workdir: Path, num_nodes: int, *, simulation: bool = False, num_partitions: int | None = None,
                 secure: bool | None = None, unregistered_nodes: int = 0, anonymous_nodes: int = 0,
                 untrusting_nodes: int = 0, workers: bool = False, worker_command: list[str] | None = None,
                 poll_interval: float | None = None):
        self.workdir = workdir
        self.home = workdir / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.num_nodes, self.simulation = num_nodes, simulation
        self.num_partitions = num_nodes if num_partitions is None else num_partitions  # fewer nodes: a broken one
        self.secure = not simulation if secure is None else secure
        if (unregistered_nodes or anonymous_nodes or untrusting_nodes) and (simulation or not self.secure):
            raise ValueError("unregistered, anonymous and untrusting SuperNodes need a secured deployment")
        self.unregistered_nodes, self.anonymous_nodes = unregistered_nodes, anonymous_nodes
        self.untrusting_nodes = untrusting_nodes
        self.procs = Processes(flower_env(self.home), workdir / "logs")
        if poll_interval is not None:
            self.procs.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(poll_interval)
        if workers and simulation:
            raise ValueError("warm workers sit beside a deployment's SuperNodes; a simulation keeps its own")
        self.workers = workers
        self.worker_command = worker_command or ["hf-fedtask", "flower", "worker"]
        # Unix socket paths are limited to 107 bytes, so the sockets live in a short folder of their own
        self.sockets = Path(tempfile.mkdtemp(prefix="hff-")) if workers else None
        self.port = free_port()
        self.connection = "loopback"
        self.credentials = None
        self.extra: dict[str, subprocess.Popen] = {}
        trust = "insecure = true\n"
        if self.secure:
            from hf_fedtask.engine.flower.credentials import write_credentials

            nodes = 0 if simulation else num_nodes + unregistered_nodes + untrusting_nodes
            self.credentials = write_credentials(workdir / "credentials", max(nodes, 1), overwrite=True)
            trust = f"root-certificates = \"{self.credentials.ca_cert.resolve()}\"\n"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n' + trust)
        self.startup_s = None

    def __enter__(self) -> LoopbackFederation:
        start = time.monotonic()
        try:
            self.start_superlink()
            if not self.simulation:
                n, creds = self.num_nodes, self.credentials
                if creds is not None:  # every key but the unregistered nodes', before any SuperNode starts
                    u, t = self.unregistered_nodes, self.untrusting_nodes
                    self.register([creds.node_pub(k) for k in [*range(n), *range(n + u, n + u + t)]])
                sockets = [self.start_worker(i) for i in range(n)] if self.workers else [None] * n
                for i in range(n):
                    self.start_supernode(f"supernode-{i}", i, key=None if creds is None else creds.node_key(i),
                                         worker=sockets[i])
                self._start_intruders()
        except BaseException:
            print(self.procs.tail(), file=sys.stderr)  # the processes' own logs say why
            self.procs.stop()
            raise
        self.startup_s = time.monotonic() - start
        return self

    def _start_intruders(self) -> None:
        """The SuperNodes that must be kept out, with partition-ids past the run's."""
        n, partition = self.num_nodes, self.num_partitions
        for j in range(self.unregistered_nodes):
            self.extra[f"unregistered-{j}"] = self.start_supernode(f"unregistered-{j}", partition,
                                                                   key=self.credentials.node_key(n + j))
            partition += 1
        for j in range(self.anonymous_nodes):
            self.extra[f"anonymous-{j}"] = self.start_supernode(f"anonymous-{j}", partition)
            partition += 1
        if self.untrusting_nodes:
            from hf_fedtask.engine.flower.credentials import write_credentials

            other = write_credentials(self.workdir / "untrusted-ca", 1, overwrite=True).ca_cert
        for j in range(self.untrusting_nodes):
            key = self.credentials.node_key(n + self.unregistered_nodes + j)
            self.extra[f"untrusting-{j}"] = self.start_supernode(f"untrusting-{j}", partition, key=key,
                                                                 root_certificates=other)
            partition += 1

    def start_superlink(self) -> subprocess.Popen:
        """Start the SuperLink (TLS and SuperNode authentication when secured) and wait for its health check."""
        tls = ["--insecure"]
        if self.credentials is not None:
            creds = self.credentials
            tls = ["--ssl-ca-certfile", str(creds.ca_cert), "--ssl-certfile", str(creds.superlink_cert),
                   "--ssl-keyfile", str(creds.superlink_key)]
            if not self.simulation:  # a simulation has no SuperNodes to authenticate
                tls.append("--enable-supernode-auth")
        args = ["flower-superlink", *tls, *(["--simulation"] if self.simulation else []), "--host", "127.0.0.1",
                "--port", str(self.port), "--disable-runtime-dependency-installation"]
        link = self.procs.start("superlink", *args)
        wait_healthy(self.port, link, ca=None if self.credentials is None else self.credentials.ca_cert)
        return link

    def register(self, public_keys: list[Path]) -> None:
        """`flwr supernode register KEY loopback` for each key (the registrations run side by side)."""
        from hf_fedtask.engine.flower.launch import flwr_executable

        flwr = flwr_executable()
        running = [(key, subprocess.Popen([flwr, "supernode", "register", str(key), self.connection],
                                          env=self.procs.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, errors="replace")) for key in public_keys]
        for key, proc in running:
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0 or "registered successfully" not in out:
                raise RuntimeError(f"flwr supernode register {key.name} failed (exit {proc.returncode}): {out[-2000:]}")

    def start_worker(self, i: int, seconds: float = 120) -> Path:
        """Start the warm worker of SuperNode `i` (logs/worker-I.log); its socket once it listens."""
        path = self.sockets / f"w{i}.sock"
        proc = self.procs.start(f"worker-{i}", *self.worker_command, "--socket", str(path))
        deadline = time.monotonic() + seconds
        while not path.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"worker {i} exited with status {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {i} opened no socket at {path} in {seconds} s")
            time.sleep(0.1)
        return path

    def start_supernode(self, name: str, partition_id: int, *, key: Path | None = None,
                        root_certificates: Path | None = None, worker: Path | None = None) -> subprocess.Popen:
        """Start one SuperNode holding `partition_id`, logging to logs/NAME.log. In a secured federation
        it trusts `root_certificates` (default: the federation's CA) and authenticates with `key` (its
        private key; None: it has none); else it speaks plain HTTP. `worker`: the socket of its warm worker."""
        if self.credentials is None:
            security = ["--insecure"]
        else:
            ca = root_certificates if root_certificates is not None else self.credentials.ca_cert
            security = ["--root-certificates", str(ca),
                        *(["--auth-supernode-private-key", str(key)] if key is not None else [])]
        return self.procs.start(name, "flower-supernode", *security, "--superlink", f"127.0.0.1:{self.port}",
                                "--port", str(free_port()), "--node-config",
                                f"partition-id={partition_id} num-partitions={self.num_partitions}"
                                + (f" worker='{worker}'" if worker is not None else ""))

    def log(self, name: str) -> str:
        """What process `name` (superlink, supernode-I, or a name of `extra`) printed so far."""
        return (self.procs.logs / f"{name}.log").read_text(errors="replace")

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
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)
