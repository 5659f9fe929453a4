"""The secured Flower deployment (TLS and SuperNode authentication, the default of
docs/tutorials/secured-deployment.md) on loopback, with real SuperLink and SuperNode processes (`-m slow`): a run
over it equals the in-process run; a SuperNode whose key was never registered, and one that does not trust the
federation's CA, are kept out and handle nothing, as is one with no key (which asks to register itself: what
`--enable-supernode-auth` forbids); too few authenticated SuperNodes fail the run in one line, in bounded time.

One federation serves the module: a SuperLink with `--enable-supernode-auth`, three registered
SuperNodes, and one unregistered, one keyless and one untrusting SuperNode (their partition-ids lie
past the run's, so any one let in would break the run)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("flwr")

from test_flower import APP_DIR, assert_same_run, tiny

from hf_fedtask.cli import main as cli_main
from hf_fedtask.config import RunConfig
from hf_fedtask.engine.flower.launch import flwr_executable
from hf_fedtask.engine.flower.loopback import LoopbackFederation
from hf_fedtask.engine.run import run

pytestmark = pytest.mark.slow

NUM_NODES = 3
HANDLED = ("Receiving: ", "Sending: ", "[RUN ")  # what a SuperNode logs for each message it handles


@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_bert_dir, tiny_tasks_dir):
    """(federation, the run's config, wall seconds of the run) once the FedAvg run finished on it."""
    work = tmp_path_factory.mktemp("secured")
    config = tiny(tiny_bert_dir, tiny_tasks_dir, work / "flower", "fedavg", num_clients=NUM_NODES, rounds=1)
    with LoopbackFederation(work / "federation", NUM_NODES, unregistered_nodes=1, anonymous_nodes=1,
                            untrusting_nodes=1) as federation:
        print(f"secured federation up in {federation.startup_s:.1f} s")
        start = time.monotonic()
        federation.launch(config, app_dir=APP_DIR, wait=120.0)
        seconds = time.monotonic() - start
        print(f"secured loopback run: {seconds:.1f} s")
        yield federation, config, seconds


def _nodes(federation: LoopbackFederation) -> list[dict]:
    """`flwr supernode ls --format json` on the federation's connection."""
    proc = subprocess.run([flwr_executable(), "supernode", "ls", federation.connection, "--format", "json"],
                          env=federation.procs.env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout[proc.stdout.index("{"):])["nodes"]


def test_the_authenticated_tls_deployment_equals_the_in_process_run(secured, tmp_path):
    federation, config, _ = secured
    link = federation.log("superlink")
    assert "SuperNode authentication is disabled" not in link and "--insecure" not in link
    assert 'root-certificates = "' in (federation.home / "config.toml").read_text()
    for i in range(NUM_NODES):
        assert any(marker in federation.log(f"supernode-{i}") for marker in HANDLED), f"supernode-{i} idle"
    reference = tmp_path / "reference"
    run(RunConfig.from_dict({**config.to_dict(), "output_dir": str(reference)}))
    assert_same_run(reference, Path(config.output_dir))


@pytest.mark.parametrize("name,refusal", [
    ("unregistered-0", "Failed to activate SuperNode"),  # a valid key the SuperLink does not know
    ("anonymous-0", "All SuperNodes must be registered via the CLI"),  # no key: it asks to register itself
])
def test_a_supernode_without_a_registered_key_is_refused_and_handles_nothing(secured, name, refusal):
    federation, _, _ = secured
    assert federation.extra[name].wait(timeout=60) != 0  # it gave up on its own, refused
    log = federation.log(name)
    assert refusal in log and "SuperNode ID:" not in log
    assert not any(marker in log for marker in HANDLED)
    nodes = _nodes(federation)
    # the three clients' keys and the untrusting node's are registered; only the three came online
    assert len(nodes) == NUM_NODES + 1
    assert sum(n["status"] == "online" for n in nodes) == NUM_NODES


def test_a_supernode_that_does_not_trust_the_ca_cannot_connect(secured):
    federation, _, _ = secured
    node = federation.extra["untrusting-0"]
    assert node.wait(timeout=60) != 0
    log = federation.log("untrusting-0")
    assert "SSL/TLS handshake error" in log and "CERTIFICATE_VERIFY_FAILED" in log
    assert "SuperNode ID:" not in log and not any(marker in log for marker in HANDLED)
    # its key is registered: only TLS kept it out
    assert sum(n["status"] == "registered" for n in _nodes(federation)) == 1


def test_too_few_authenticated_supernodes_fail_the_run_in_one_line(secured, tmp_path, monkeypatch, capsys):
    federation, config, _ = secured
    wants_more = tiny(config.base_model, config.tasks, tmp_path / "short", "fedavg", num_clients=NUM_NODES + 1)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(wants_more.to_dict()))
    monkeypatch.setenv("FLWR_HOME", str(federation.home))
    capsys.readouterr()
    start = time.monotonic()
    code = cli_main(["flower", "run", "--config", str(tmp_path / "run.yaml"), "--connection", federation.connection,
                     "--app-dir", str(APP_DIR), "--wait", "5"])
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    print(f"too few SuperNodes: exit {code} after {seconds:.1f} s")
    assert code == 2
    (line,) = err.splitlines()
    assert line.startswith("hf-fedtask: error: Flower run ")
    assert f"the federation has {NUM_NODES} nodes after waiting 5 s but this run has {NUM_NODES + 1} clients" in line
    assert seconds < 120  # the ServerApp's start and 5 s of waiting, not a hang
    assert not (tmp_path / "short").exists()
