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

Security: a request carries the node's secure-aggregation secret and the client's private store, so
each side proves who it is before one is sent. The worker creates its Unix socket mode 0600 and, before
listening, a key file (`PATH.key`, or `--authkey-file`; 32 random bytes, mode 0600, removed with the
socket). The ClientApp refuses unless the key file and the socket are its user's and closed to group and
others, the peer runs as its uid (SO_PEERCRED, Linux), and the worker answers the HMAC challenge of
`multiprocessing.connection` (the one `Client(authkey=...)` runs, both ways, with a key per direction
derived from the file's); the worker likewise challenges every connection before it reads a request.

Robustness: each connection is served on its own thread; its request must arrive within
`request_timeout` seconds (the handling may take as long as training does), frames have size limits, and
a malformed request is answered with a one-line error and logged while the worker lives on. Requests are
handled one at a time (the environment is not thread-safe). The request, its framing and its checks are
`hf_fedtask.engine.flower.request`'s.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import signal
import socket
import stat
import struct
import sys
import threading
import time
import traceback
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from pathlib import Path

from hf_fedtask.engine.flower.request import MAX_FRAME, MAX_HEADER, ClientRequest, ClientResult, one_line
from hf_fedtask.errors import FedTaskError, WorkerError

WORKER = "worker"  # the node-config key naming the worker's socket
WORKER_KEY = "worker-key"  # the node-config key naming its key file, where it is not PATH.key
KEY_SUFFIX = ".key"
KEY_BYTES = 32
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes on Linux, the last one a NUL
REQUEST_TIMEOUT = 60.0  # seconds for a connection to deliver its whole request (not to handle it)
HANDSHAKE_TIMEOUT = 60.0  # seconds the ClientApp waits for the worker's side of the challenge
MAX_CONNECTIONS = 64  # connections served at once; more are closed at once
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (Linux socket(7))


def worker_address(node_config) -> str | None:
    """The worker socket this SuperNode was started with (`--node-config "... worker='PATH'"`), or None."""
    value = node_config.get(WORKER)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise WorkerError(f"node config {WORKER}={value!r}: expected the worker's socket path as a quoted string, "
                          f"e.g. --node-config \"partition-id=0 num-partitions=4 {WORKER}='/run/hf-fedtask/w0.sock'\"")
    return value


def worker_key_file(node_config, address: str) -> str:
    """The worker's key file: `worker-key='PATH'` in the node config, else the socket path + `.key`."""
    value = node_config.get(WORKER_KEY)
    if value is None:
        return address + KEY_SUFFIX
    if not isinstance(value, str) or not value:
        raise WorkerError(f"node config {WORKER_KEY}={value!r}: expected the worker's key file as a quoted string "
                          f"(the worker's --authkey-file)")
    return value


def forward(address: str, request: ClientRequest, key_file: str | None = None,
            handshake_timeout: float = HANDSHAKE_TIMEOUT) -> ClientResult:
    """Send `request` to the worker at `address` and wait for its result. The worker must first prove it
    holds the key in `key_file` (default `address` + `.key`); nothing of the request is sent before."""
    key_file = key_file or address + KEY_SUFFIX
    conn = _authenticated(address, key_file, handshake_timeout, f"client {request.client}'s secret and store")
    with conn:
        try:
            request.send(conn)
        except OSError:
            pass  # the worker refused the request part-way (too large?): its reply says why
        try:
            header = json.loads(conn.recv_bytes(MAX_HEADER))
            reply, store = conn.recv_bytes(), conn.recv_bytes()
        except (EOFError, OSError):
            raise WorkerError(f"the worker on {address} closed the connection before answering client "
                              f"{request.client} (round {request.instruction.round}); see the worker's log") from None
        except ValueError as e:
            raise WorkerError(f"the worker on {address} sent client {request.client} a reply header that is not "
                              f"JSON ({one_line(e)})") from None
    if not isinstance(header, dict) or not isinstance(header.get("ok"), bool):
        raise WorkerError(f"the worker on {address} sent client {request.client} a reply header without 'ok'")
    if not header["ok"]:
        raise WorkerError(f"worker on {address}, client {request.client}: {one_line(header.get('error'))}")
    return ClientResult(reply, store)


def _authenticated(address: str, key_file: str, timeout: float, what: str) -> Connection:
    """A connection to the worker at `address`, once the socket, the peer and the key check out."""
    refusing = f"refusing to send {what}"
    try:
        st = os.stat(address)
    except FileNotFoundError:
        raise _no_worker(address, "FileNotFoundError") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise WorkerError(f"worker socket {address} is not a socket; {refusing}")
    _check_private(address, "worker socket", st, refusing)
    key = _read_key(key_file, address, refusing)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise _no_worker(address, type(e).__name__) from None
        except OSError as e:
            raise WorkerError(f"cannot connect to the worker on {address} ({one_line(e)})") from None
        uid = _peer_uid(sock)
        if uid is not None and uid != os.getuid():
            raise WorkerError(f"the process listening on {address} runs as uid {uid}, not as this user "
                              f"(uid {os.getuid()}); {refusing}")
        _receive_timeout(sock, timeout)  # a listener that never answers the challenge is refused, not waited on
        conn = Connection(os.dup(sock.fileno()))
        clientapp_key, worker_key = _direction_keys(key)
        try:  # what Client(authkey=...) runs: this side answers the worker's challenge, then the worker ours
            answer_challenge(conn, clientapp_key)
            deliver_challenge(conn, worker_key)
        except (AuthenticationError, AssertionError, EOFError, OSError) as e:
            conn.close()
            why = (f"no answer in {timeout:g} s" if isinstance(e, BlockingIOError)
                   else f"{type(e).__name__}: {one_line(e)}")
            raise WorkerError(f"the listener on {address} failed the handshake with key {key_file} ({why}); "
                              f"{refusing}") from None
        _receive_timeout(sock, 0)  # the handling takes as long as training does
        return conn
    finally:
        sock.close()  # `conn` holds its own descriptor of the socket


def _no_worker(address: str, why: str) -> WorkerError:
    return WorkerError(f"no hf-fedtask worker listens on {address} ({why}); start "
                       f"`hf-fedtask flower worker --socket {address}` beside this SuperNode")


def _check_private(path: str, what: str, st: os.stat_result, refusing: str) -> None:
    if st.st_uid != os.getuid():
        raise WorkerError(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); "
                          f"{refusing}")
    if st.st_mode & 0o077:
        raise WorkerError(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: open to group or others, it must "
                          f"be 0600; {refusing}")


def _read_key(path: str, address: str, refusing: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise WorkerError(f"worker key {path} does not exist (the worker on {address} writes it when it starts); "
                          f"{refusing}") from None
    except OSError as e:
        raise WorkerError(f"worker key {path}: {one_line(e)}; {refusing}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise WorkerError(f"worker key {path} is not a regular file; {refusing}")
        _check_private(path, "worker key", st, refusing)
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise WorkerError(f"worker key {path} holds {len(key)}{'+' if len(key) > KEY_BYTES else ''} bytes, not the "
                          f"{KEY_BYTES} a worker writes; {refusing}")
    return key


def _direction_keys(key: bytes) -> tuple[bytes, bytes]:
    """The keys a ClientApp and a worker answer challenges with: one per direction, so that no answer of
    one side can be replayed to answer a challenge to the other side (a reflection between connections)."""
    return (hmac.new(key, b"hf-fedtask flower clientapp", "sha256").digest(),
            hmac.new(key, b"hf-fedtask flower worker", "sha256").digest())


def _peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux SO_PEERCRED); None elsewhere."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    _, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return uid


def _receive_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO (socket(7)): a blocking read fails with EAGAIN after `seconds` (0: waits forever). The
    descriptor stays blocking, as `multiprocessing.connection.Connection` needs."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


class _Deadline:
    """Ends a read still blocked after `seconds`: it shuts the socket's read side (the read then sees the
    end of the stream, and a reply can still be sent)."""

    def __init__(self, sock: socket.socket, seconds: float):
        self.seconds, self.expired = seconds, False
        self._timer = threading.Timer(seconds, self._expire, (sock,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, sock: socket.socket) -> None:
        self.expired = True
        try:
            sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass  # already closed

    def cancel(self) -> None:
        self._timer.cancel()


class Worker:
    """Serves `ClientRequest`s on a Unix socket with `handle` (warm across requests): each connection on
    its own thread, the handling one request at a time. Refuses to start where another worker is
    listening; removes a stale socket file and key file of a dead one."""

    def __init__(self, address: str | Path, authkey_file: str | Path | None = None,
                 request_timeout: float = REQUEST_TIMEOUT, max_header: int = MAX_HEADER, max_frame: int = MAX_FRAME,
                 max_connections: int = MAX_CONNECTIONS):
        self.address = str(Path(address).expanduser().absolute())
        self.key_file = str(Path(authkey_file).expanduser().absolute()) if authkey_file else self.address + KEY_SUFFIX
        for name, value in (("request timeout", request_timeout), ("max header", max_header),
                            ("max frame", max_frame), ("max connections", max_connections)):
            if not value > 0:
                raise WorkerError(f"worker {self.address}: {name} {value!r} must be positive")
        self.request_timeout, self.max_header, self.max_frame = request_timeout, max_header, max_frame
        self.max_connections = max_connections
        self.listener: socket.socket | None = None
        self.served = 0
        self._key = b""
        self._key_fd: int | None = None  # held open with an flock while this worker runs
        self._socket_id: tuple[int, int] | None = None
        self._handling = threading.Lock()  # the environment handles one request at a time
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

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
        self._create_key()  # before the socket: a ClientApp that can connect finds the key
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)  # the socket file is created 0600: only this user may connect
        try:
            sock.bind(self.address)
            sock.listen(self.max_connections)
        except OSError as e:
            sock.close()
            self._remove_key()
            raise WorkerError(f"--socket {self.address}: cannot listen there ({one_line(e)})") from None
        finally:
            os.umask(umask)
        st = os.stat(self.address)
        self._socket_id = (st.st_dev, st.st_ino)
        self.listener = sock

    def _create_key(self) -> None:
        """Write a fresh key, mode 0600, with O_EXCL (never into a file someone else made); a dead worker's
        key (a 0600 file of this user's, of the key's size, locked by no running worker) is replaced."""
        path = self.key_file
        if os.path.lexists(path):
            self._remove_stale_key(path)
        import fcntl  # POSIX only, as Unix sockets are: the ClientApp module stays importable anywhere

        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise WorkerError(f"worker key {path}: cannot create it ({one_line(e)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # marks the key as a running worker's
            os.fchmod(fd, 0o600)
            key = secrets.token_bytes(KEY_BYTES)
            os.write(fd, key)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise WorkerError(f"worker key {path}: cannot write it ({one_line(e)})") from None
        self._key, self._key_fd = key, fd

    @staticmethod
    def _remove_stale_key(path: str) -> None:
        import fcntl

        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise WorkerError(f"worker key {path} exists and cannot be opened ({one_line(e)}); remove it or choose "
                              "another --authkey-file") from None
        try:
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
                    and st.st_size == KEY_BYTES):
                raise WorkerError(f"worker key {path} exists and is not a stale worker key (a {KEY_BYTES}-byte file "
                                  "of this user's, mode 0600); remove it or choose another --authkey-file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise WorkerError(f"worker key {path} belongs to a running worker; give each worker its own "
                                  "--authkey-file") from None
            os.unlink(path)
        finally:
            os.close(fd)

    def _remove_key(self) -> None:
        if self._key_fd is None:
            return
        try:
            st, now = os.fstat(self._key_fd), os.lstat(self.key_file)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(self.key_file)
        except OSError:
            pass  # removed already
        os.close(self._key_fd)
        self._key_fd = None

    def serve(self, handle, log=sys.stderr) -> None:
        """Accept connections until `close`, serving each on its own thread."""
        if self.listener is None:
            self.open()
        listener = self.listener
        while self.listener is listener:
            try:
                sock, _ = listener.accept()
            except OSError as e:
                if self.listener is not listener:
                    return  # closed
                _log(log, f"accept failed ({one_line(e)}); retrying")  # e.g. out of descriptors: wait, then go on
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                _log(log, f"refused a connection: {self.max_connections} connections are open already")
                sock.close()
                continue
            threading.Thread(target=self._connection, args=(sock, handle, log), daemon=True,
                             name="hf-fedtask-worker-connection").start()

    def serve_forever(self, handle, log=sys.stderr) -> None:
        """Answer requests until SIGTERM / SIGINT; every failure is sent back as the reply's error line."""
        if self.listener is None:
            self.open()
        signal.signal(signal.SIGTERM, _interrupt)
        _log(log, f"listening on {self.address} (key {self.key_file})")
        try:
            self.serve(handle, log)
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def _connection(self, sock: socket.socket, handle, log) -> None:
        with self._open_lock:
            self._open.add(sock)
        deadline = _Deadline(sock, self.request_timeout)
        conn = None
        try:
            conn = Connection(os.dup(sock.fileno()))
            request = self._receive(sock, conn, deadline, log)
            deadline.cancel()
            if request is not None:
                self._answer(conn, request, handle, log)
        except Exception as e:  # noqa: BLE001  (one connection's failure never ends the worker)
            _log(log, f"a connection failed ({type(e).__name__}: {one_line(e)})")
        finally:
            deadline.cancel()
            if conn is not None:
                conn.close()
            with self._open_lock:
                self._open.discard(sock)
            sock.close()
            self._slots.release()

    def _receive(self, sock: socket.socket, conn: Connection, deadline: _Deadline, log) -> ClientRequest | None:
        """The connection's request, once its peer proved it holds the key; None (logged, and answered
        where the peer is authenticated) if it did not arrive whole and valid in time."""
        uid = _peer_uid(sock)
        if uid is not None and uid != os.getuid():
            _log(log, f"refused a connection from uid {uid} (this worker runs as uid {os.getuid()})")
            return None
        clientapp_key, worker_key = _direction_keys(self._key)
        try:  # what Listener(authkey=...).accept() runs, in this connection's thread (not in the accept loop)
            deliver_challenge(conn, clientapp_key)
            answer_challenge(conn, worker_key)
        except (AuthenticationError, AssertionError, EOFError, OSError) as e:
            why = (f"no handshake within {deadline.seconds:g} s" if deadline.expired
                   else f"{type(e).__name__}: {one_line(e) or 'no answer'}")
            _log(log, f"refused a connection that failed the handshake ({why})")
            return None
        try:
            return ClientRequest.receive(conn, self.max_header, self.max_frame)
        except WorkerError as e:
            error = f"no complete request within {deadline.seconds:g} s" if deadline.expired else str(e)
        _log(log, f"refused a request: {error}; closed the connection")
        try:
            _send_reply(conn, {"ok": False, "error": error}, b"", b"")
        except OSError:
            pass  # the peer went away
        return None

    def _answer(self, conn: Connection, request: ClientRequest, handle, log) -> None:
        start = time.perf_counter()
        with self._handling:
            try:
                result = handle(request)
                header, reply, store = {"ok": True}, result.reply, result.store
            except FedTaskError as e:
                header, reply, store = {"ok": False, "error": one_line(e)}, b"", b""
            except Exception as e:  # noqa: BLE001  (any failure becomes the client's error reply; the worker lives on)
                traceback.print_exc(file=log)
                header, reply, store = {"ok": False, "error": f"{type(e).__name__}: {one_line(e)}"}, b"", b""
        ins = request.instruction
        try:
            _send_reply(conn, header, reply, store)
        except OSError as e:
            _log(log, f"client {request.client} round {ins.round} {ins.kind}: the ClientApp went away before the "
                      f"reply ({one_line(e)})")
            return
        self.served += 1
        _log(log, f"client {request.client} round {ins.round} {ins.kind} "
                  f"{'ok' if header['ok'] else 'failed: ' + header['error']} in {time.perf_counter() - start:.2f} s")

    def close(self) -> None:
        """Stop accepting, end the connections still open, remove the socket file and the key file."""
        listener, self.listener = self.listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept (Linux)
            except OSError:
                pass
            listener.close()
            try:
                st = os.lstat(self.address)
                if (st.st_dev, st.st_ino) == self._socket_id:
                    os.unlink(self.address)
            except OSError:
                pass  # removed already
        with self._open_lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._remove_key()


def _send_reply(conn: Connection, header: dict, reply: bytes, store: bytes) -> None:
    conn.send_bytes(json.dumps(header).encode())
    conn.send_bytes(reply)
    conn.send_bytes(store)


def _log(log, line: str) -> None:
    log.write(f"hf-fedtask worker: {line}\n")  # one write per line: threads do not interleave within one
    log.flush()


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the worker as Ctrl-C does: the socket file is removed


def _listening(address: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(address)
            return True
        except OSError:
            return False


def serve(address: str | Path, threads: int | None = None, authkey_file: str | Path | None = None,
          request_timeout: float = REQUEST_TIMEOUT, max_frame: int = MAX_FRAME) -> None:
    """`hf-fedtask flower worker`: import the client half now (once), then serve on `address`."""
    worker = Worker(address, authkey_file=authkey_file, request_timeout=request_timeout, max_frame=max_frame)
    worker.open()  # refuse a busy socket before the slow imports
    try:
        from hf_fedtask.engine.flower.handler import handle

        if threads:
            import torch

            torch.set_num_threads(threads)
    except BaseException:
        worker.close()
        raise
    worker.serve_forever(handle)
