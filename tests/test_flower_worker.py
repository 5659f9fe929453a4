"""The warm client worker (`hf-fedtask flower worker`): a ClientApp on a SuperNode started with
`worker='PATH'` forwards each instruction and its node state over the Unix socket, and the run must be
the in-process run (same checkpoint, metrics and payloads). Its failures are one line naming the socket
or the client, and the ClientApp it serves imports no torch."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from served_worker import ServedWorker

pytest.importorskip("flwr")

import test_flower
from test_flower import assert_same_run, drive, records, tiny
from test_flower_worker_guard import header

from hf_fedtask.engine.flower import handler
from hf_fedtask.engine.flower.request import ClientRequest
from hf_fedtask.engine.flower.worker import _authenticated, forward
from hf_fedtask.engine.messages import Instruction
from hf_fedtask.errors import WorkerError

reference_run = test_flower.reference_run  # the fixture: a run in process, to compare with


@pytest.fixture
def served(tmp_path):
    workers = []

    def _start(handle=handler.handle):
        folder = tmp_path / f"w{len(workers)}"
        folder.mkdir()
        workers.append(ServedWorker(folder, handle))
        return workers[-1]

    yield _start
    for w in workers:
        w.close()


def test_a_run_whose_clients_forward_to_a_worker_equals_the_in_process_run(tiny_bert_dir, tiny_tasks_dir, tmp_path,
                                                                           reference_run, served):
    worker = served()
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", "fedper", rounds=2)
    grid = drive(config, node_config={"worker": worker.path})
    assert_same_run(reference_run(config), tmp_path / "flower", grid.stores())
    trained = [r for r in worker.requests if r[1] == "train"]
    assert sorted(trained) == sorted((c, "train", r) for c in range(4) for r in (1, 2))  # every client, every round
    assert stat.S_IMODE(os.stat(worker.path).st_mode) == 0o600


def test_a_worker_failure_is_the_clients_failure_with_its_reason(tiny_bert_dir, tiny_tasks_dir, tmp_path, served):
    def failing(request):
        if request.client == 1 and request.instruction.kind == "train":
            raise RuntimeError("disk full on client 1")
        return handler.handle(request)

    worker = served(failing)
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", rounds=1)
    drive(config, node_config={"worker": worker.path})
    (record,) = records(tmp_path / "flower")
    assert record["clients"] == [0, 2, 3]
    reason = record["failed_clients"]["1"]
    assert f"worker on {worker.path}, client 1: RuntimeError: disk full on client 1" in reason


def test_no_worker_on_the_socket_is_one_line_naming_it(tmp_path):
    path = str(tmp_path / "absent.sock")
    request = ClientRequest({}, 0, b"\0" * 32, Instruction("train", 1, 0, b""))
    with pytest.raises(WorkerError, match=f"no hf-fedtask worker listens on {path} .*hf-fedtask flower worker "
                                          f"--socket {path}") as e:
        forward(path, request)
    assert "\n" not in str(e.value)


def test_a_second_worker_on_the_same_socket_is_refused_and_the_first_keeps_serving(tmp_path, served):
    worker = served(lambda request: handler.ClientResult(b"pong", b""))
    cli = subprocess.run([sys.executable, "-m", "hf_fedtask.cli", "flower", "worker", "--socket", worker.path],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2
    assert cli.stderr.strip().splitlines() == [f"hf-fedtask: error: --socket {worker.path}: another worker is "
                                               "listening there; stop it first or give each SuperNode's worker its "
                                               "own socket"]
    result = forward(worker.path, ClientRequest({}, 0, b"\0" * 32, Instruction("train", 1, 0, b"x")))
    assert result.reply == b"pong"


def test_the_worker_process_serves_and_stops_on_sigterm_removing_its_socket(tmp_path):
    path = tmp_path / "w.sock"
    proc = subprocess.Popen([sys.executable, "-m", "hf_fedtask.cli", "flower", "worker", "--socket", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert path.is_socket() and stat.S_IMODE(os.stat(f"{path}.key").st_mode) == 0o600
        conn = _authenticated(str(path), f"{path}.key", 30, "a malformed request")
        with conn:  # once crashed the worker process with a TypeError
            conn.send_bytes(json.dumps({**header(), "round": None}).encode())
            try:
                conn.send_bytes(b"")
                conn.send_bytes(b"")
            except BrokenPipeError:
                pass  # the worker refused on the header alone and closed; its reply is still to read
            assert json.loads(conn.recv_bytes(1 << 20)) == {
                "ok": False, "error": "the request header's 'round' is null, expected an int >= 0"}
        request = ClientRequest({"config": "{}"}, 0, b"\0" * 32, Instruction("train", 1, 0, b""))
        with pytest.raises(WorkerError, match="client 0: Flower run config: config holds no RunConfig"):
            forward(str(path), request)  # served by the real handler: a bad run config is the reply's error
        assert proc.poll() is None
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and not path.exists() and not Path(f"{path}.key").exists()
    assert "hf-fedtask worker: refused a request: the request header's 'round' is null, expected an int >= 0" in err


def test_the_clientapp_module_imports_no_torch():
    code = ("import sys, hf_fedtask.engine.flower.app; "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_a_secured_loopback_deployment_with_warm_workers_equals_the_in_process_run(tiny_bert_dir, tiny_tasks_dir,
                                                                                   tmp_path, reference_run):
    from test_flower import APP_DIR

    from hf_fedtask.engine.flower.loopback import LoopbackFederation

    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", "fedper", num_clients=3)
    with LoopbackFederation(tmp_path / "federation", 3, workers=True, poll_interval=0.2) as federation:
        federation.launch(config, app_dir=APP_DIR, wait=120.0)
        served = [federation.log(f"worker-{i}") for i in range(3)]
    assert_same_run(reference_run(config), tmp_path / "flower")
    for i, log in enumerate(served):  # every train message of client i was answered by its own warm worker
        assert [line.split(" round ")[1].split()[0] for line in log.splitlines() if f"client {i} round" in line
                and " train ok " in line] == ["1", "2"]
