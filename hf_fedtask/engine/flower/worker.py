"""A warm client worker beside a SuperNode, and the thin ClientApp side that forwards to it.

Flower 1.41 starts a fresh `flwr-clientapp` process for every message (a non-ephemeral ClientApp is
flwrlabs/flower#3670, still open), so a ClientApp that trains would import torch, transformers and
hf_fedtask and rebuild its environment (model, data partition, tokenized inputs) on every message. As
NVFlare does with its external process, `hf-fedtask flower worker --socket PATH` is started once beside
each SuperNode and keeps that environment warm across messages and rounds; the SuperNode is told where
with `--node-config "... worker='PATH'"`, and its ClientApp (`hf_fedtask.engine.flower.app`) then only
forwards the instruction's bytes and the node's state over the local socket and returns the reply.
The worker answers with the same `hf_fedtask.engine.flower.handler.handle` a ClientApp without a worker
runs itself, so the replies are the same bytes.

The socket is a Unix domain socket created with mode 0600: only the user running the SuperNode and the
worker can connect. Framing is `multiprocessing.connection`'s (length-prefixed byte messages; nothing
is pickled): a JSON header, then the payload, then the store.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from hf_fedtask.engine.messages import Instruction
from hf_fedtask.errors import FedTaskError, WorkerError

WORKER = "worker"  # the node-config key naming the worker's socket
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes on Linux, the last one a NUL


@dataclass
class ClientRequest:
    """One message for a client, as its ClientApp received it: the run config (Flower's flat map), the
    client id, the node's secure-aggregation secret, the instruction and the node's packed store."""

    run_config: dict
    client: int
    secret: bytes
    instruction: Instruction
    store: bytes | None = None

    def send(self, conn: Connection) -> None:
        ins = self.instruction
        header = {"run_config": self.run_config, "client": self.client, "secret": self.secret.hex(),
                  "kind": ins.kind, "round": ins.round, "client_id": ins.client_id, "config": ins.config,
                  "store": self.store is not None}
        conn.send_bytes(json.dumps(header).encode())
        conn.send_bytes(ins.payload)
        conn.send_bytes(self.store or b"")

    @classmethod
    def receive(cls, conn: Connection) -> ClientRequest:
        header = json.loads(conn.recv_bytes())
        payload, store = conn.recv_bytes(), conn.recv_bytes()
        ins = Instruction(header["kind"], int(header["round"]), int(header["client_id"]), payload, header["config"])
        return cls(header["run_config"], int(header["client"]), bytes.fromhex(header["secret"]), ins,
                   store if header["store"] else None)


@dataclass
class ClientResult:
    """The reply's bytes and the client's store afterwards (packed), to keep in the node's state."""

    reply: bytes
    store: bytes


def worker_address(node_config) -> str | None:
    """The worker socket this SuperNode was started with (`--node-config "... worker='PATH'"`), or None."""
    value = node_config.get(WORKER)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise WorkerError(f"node config {WORKER}={value!r}: expected the worker's socket path as a quoted string, "
                          f"e.g. --node-config \"partition-id=0 num-partitions=4 {WORKER}='/run/hf-fedtask/w0.sock'\"")
    return value


def forward(address: str, request: ClientRequest) -> ClientResult:
    """Send `request` to the worker at `address` and wait for its result."""
    try:
        conn = Client(address, family="AF_UNIX")
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise WorkerError(f"no hf-fedtask worker listens on {address} ({type(e).__name__}); start "
                          f"`hf-fedtask flower worker --socket {address}` beside this SuperNode") from None
    with conn:
        request.send(conn)
        try:
            header = json.loads(conn.recv_bytes())
            reply, store = conn.recv_bytes(), conn.recv_bytes()
        except (EOFError, ConnectionResetError):
            raise WorkerError(f"the worker on {address} closed the connection before answering client "
                              f"{request.client} (round {request.instruction.round}); see the worker's log") from None
    if not header["ok"]:
        raise WorkerError(f"worker on {address}, client {request.client}: {header['error']}")
    return ClientResult(reply, store)


class Worker:
    """Serves `ClientRequest`s on a Unix socket, one at a time, with `handle` (warm across requests).
    Refuses to start where another worker is listening; removes a stale socket file of a dead one."""

    def __init__(self, address: str | Path):
        self.address = str(Path(address).expanduser().absolute())
        self.listener: Listener | None = None
        self.served = 0

    def open(self) -> None:
        path = Path(self.address)
        if path.exists():
            if _listening(self.address):
                raise WorkerError(f"--socket {self.address}: another worker is listening there; stop it first or "
                                  "give each SuperNode's worker its own socket")
            if not path.is_socket():
                raise WorkerError(f"--socket {self.address}: the path exists and is not a socket")
            path.unlink()  # a dead worker's socket file
        if not path.parent.is_dir():
            raise WorkerError(f"--socket {self.address}: folder {path.parent} does not exist")
        if len(os.fsencode(self.address)) > MAX_SOCKET_PATH:
            raise WorkerError(f"--socket {self.address}: {len(os.fsencode(self.address))} bytes, longer than a Unix "
                              f"socket path may be ({MAX_SOCKET_PATH}); use a shorter path, e.g. under /tmp")
        umask = os.umask(0o177)  # the socket file is created 0600: only this user may connect
        try:
            self.listener = Listener(self.address, family="AF_UNIX")
        finally:
            os.umask(umask)

    def serve_forever(self, handle, log=sys.stderr) -> None:
        """Answer requests until SIGTERM / SIGINT; every failure is sent back as the reply's error line."""
        if self.listener is None:
            self.open()
        signal.signal(signal.SIGTERM, _interrupt)
        print(f"hf-fedtask worker: listening on {self.address}", file=log, flush=True)
        try:
            while True:
                with self.listener.accept() as conn:
                    self._serve(conn, handle, log)
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def _serve(self, conn: Connection, handle, log) -> None:
        start = time.perf_counter()
        try:
            request = ClientRequest.receive(conn)
        except (EOFError, OSError, ValueError, KeyError) as e:
            print(f"hf-fedtask worker: dropped a malformed request ({type(e).__name__}: {e})", file=log, flush=True)
            return
        try:
            result = handle(request)
            header, reply, store = {"ok": True}, result.reply, result.store
        except FedTaskError as e:
            header, reply, store = {"ok": False, "error": str(e)}, b"", b""
        except Exception as e:  # noqa: BLE001  (any failure becomes the client's error reply, and the worker lives on)
            traceback.print_exc(file=log)
            header, reply, store = {"ok": False, "error": f"{type(e).__name__}: {e}"}, b"", b""
        try:
            conn.send_bytes(json.dumps(header).encode())
            conn.send_bytes(reply)
            conn.send_bytes(store)
        except OSError as e:
            print(f"hf-fedtask worker: the ClientApp went away before the reply ({e})", file=log, flush=True)
            return
        self.served += 1
        ins = request.instruction
        print(f"hf-fedtask worker: client {request.client} round {ins.round} {ins.kind} "
              f"{'ok' if header['ok'] else 'failed: ' + header['error']} in {time.perf_counter() - start:.2f} s",
              file=log, flush=True)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()  # removes the socket file
            self.listener = None


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the worker as Ctrl-C does: the socket file is removed


def _listening(address: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(address)
            return True
        except OSError:
            return False


def serve(address: str | Path, threads: int | None = None) -> None:
    """`hf-fedtask flower worker`: import the client half now (once), then serve on `address`."""
    worker = Worker(address)
    worker.open()  # refuse a busy socket before the slow imports
    from hf_fedtask.engine.flower.handler import handle

    if threads:
        import torch

        torch.set_num_threads(threads)
    worker.serve_forever(handle)
