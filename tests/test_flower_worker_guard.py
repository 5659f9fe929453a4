"""The warm worker's guard (`hf_fedtask.engine.flower.worker`): a malformed, truncated, oversized or
stalled request is refused with a one-line reason while the worker serves on, one stalled connection
does not hold up another client, and the ClientApp side sends a client's secret and store only to a
listener that proves it holds the worker's key (and runs as its user). Each test serves a trivial
`handle` on a thread of this process; none imports torch."""

from __future__ import annotations

import io
import json
import os
import random
import socket
import stat
import struct
import threading
import time
from multiprocessing.connection import Listener

import pytest
from served_worker import ServedWorker

from hf_fedtask.engine.flower import worker as worker_module
from hf_fedtask.engine.flower.request import FIELDS, ClientRequest, ClientResult
from hf_fedtask.engine.flower.worker import KEY_BYTES, Worker, _authenticated, forward
from hf_fedtask.engine.messages import Instruction
from hf_fedtask.errors import WorkerError

SECRET = bytes(range(100, 132))
STORE = b"private-store-bytes-of-client-3"


def pong(request: ClientRequest) -> ClientResult:
    return ClientResult(b"pong:" + request.instruction.payload, b"store:" + (request.store or b""))


def valid_request(payload: bytes = b"ping") -> ClientRequest:
    return ClientRequest({"config": "{}"}, 3, SECRET, Instruction("train", 2, 3, payload, {"q": 1}), STORE)


def frame(data: bytes) -> bytes:
    """One `multiprocessing.connection` frame: a 4-byte big-endian length, then the bytes."""
    return struct.pack("!i", len(data)) + data


def header(**changes) -> dict:
    value = {"run_config": {"config": "{}"}, "client": 3, "secret": SECRET.hex(), "kind": "train", "round": 2,
             "client_id": 3, "config": {}, "store": True}
    value.update(changes)
    return value


def request_bytes(head) -> bytes:
    return frame(json.dumps(head).encode()) + frame(b"ping") + frame(STORE)


class Served(ServedWorker):
    """A `ServedWorker` answering with `pong` by default, its log kept; `calls` counts the requests handled."""

    def __init__(self, folder, handle=pong, **options):
        super().__init__(folder, handle, io.StringIO(), **options)

    @property
    def calls(self) -> int:
        return len(self.requests)

    def assert_serves(self):
        """The thread still accepts, and a valid request is answered with its own bytes."""
        assert self.thread.is_alive()
        result = forward(self.path, valid_request(b"check"), handshake_timeout=5)
        assert (result.reply, result.store) == (b"pong:check", b"store:" + STORE)


@pytest.fixture
def served(tmp_path):
    workers = []

    def _start(handle=pong, **options):
        folder = tmp_path / f"w{len(workers)}"
        folder.mkdir()
        workers.append(Served(folder, handle, **options))
        return workers[-1]

    yield _start
    for w in workers:
        w.close()


def raw_exchange(path: str, data: bytes, wait: float = 5) -> dict | None:
    """Authenticate as a ClientApp, write `data` as is, end the write side and read the reply's header
    (None: the worker closed without one)."""
    conn = _authenticated(path, path + ".key", 5, "test bytes")
    with conn:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            sock.sendall(data)
        except OSError:
            pass  # the worker refused part-way and closed its side; its reply is still to read
        sock.shutdown(socket.SHUT_WR)
        sock.close()
        assert conn.poll(wait), "the worker neither answered nor closed the connection"
        try:
            head = json.loads(conn.recv_bytes())
            assert conn.recv_bytes() == b"" and conn.recv_bytes() == b""
        except EOFError:
            return None
        with pytest.raises((EOFError, ConnectionResetError)):  # a reset where it closed with our bytes unread
            conn.recv_bytes()  # and then it closed the connection
        return head


MALFORMED = [  # (what is sent after the handshake, what the error line must say)
    (request_bytes([header()]), "the request header is a JSON array, expected a JSON object"),
    (request_bytes(header(round=None)), "the request header's 'round' is null, expected an int >= 0"),
    (request_bytes(header(round="2")), "'round' is \"2\", expected an int >= 0"),
    (request_bytes(header(round=True)), "'round' is true, expected an int >= 0"),
    (request_bytes(header(round=-1)), "'round' is -1, expected an int >= 0"),
    (request_bytes(header(round=2.5)), "'round' is 2.5, expected an int >= 0"),
    (request_bytes(header(client=False)), "'client' is false, expected an int >= 0"),
    (request_bytes(header(client=-3)), "'client' is -3, expected an int >= 0"),
    (request_bytes(header(client_id=None)), "'client_id' is null, expected an int"),
    (request_bytes(header(secret=5)), "'secret' is 5, expected 64 hex digits (32 bytes)"),
    (request_bytes(header(secret="zz")), "'secret' is \"zz\", expected 64 hex digits (32 bytes)"),
    (request_bytes(header(secret="abc")), "'secret' is \"abc\", expected 64 hex digits (32 bytes)"),
    (request_bytes(header(secret="")), "'secret' is \"\", expected 64 hex digits (32 bytes)"),
    (request_bytes(header(secret="z" * 64)), "'secret' is a string (\"zzzz"),
    (request_bytes(header(kind="fit")), "'kind' is \"fit\", expected one of train, query, evaluate"),
    (request_bytes(header(kind=["train"])), "'kind' is [\"train\"], expected one of"),
    (request_bytes(header(run_config=[])), "'run_config' is [], expected a JSON object"),
    (request_bytes(header(config="x")), "'config' is \"x\", expected a JSON object"),
    (request_bytes(header(store="yes")), "'store' is \"yes\", expected true or false"),
    (request_bytes(header(store=False)), "says store=false, but a store of 31 bytes follows"),
    (request_bytes(header(extra=1)), "the request header has unknown field(s) 'extra'"),
    (request_bytes(None), "the request header is null, expected a JSON object"),
    (request_bytes("text"), "the request header is a string, expected a JSON object"),
    (frame(b"{") + frame(b"") + frame(b""), "the request header is not JSON (JSONDecodeError"),
    (frame(b"\xff\xfe\xfa") + frame(b"") + frame(b""), "the request header is not JSON"),
    (frame(b"[" * 200_000), "the request header is not JSON (RecursionError"),
    (struct.pack("!i", (1 << 20) + 1), "the request's header is longer than 1048576 bytes"),
    (struct.pack("!iQ", -1, 1 << 40), "the request's header is longer than 1048576 bytes"),
    (frame(json.dumps(header()).encode()) + struct.pack("!i", (2 << 20) + 1),
     "the request's payload is longer than 2097152 bytes"),
    (frame(json.dumps(header()).encode()) + frame(b"ping") + struct.pack("!i", 1 << 30),
     "the request's store is longer than 2097152 bytes"),
    (b"", "the connection ended before the request's header"),
    (frame(json.dumps(header()).encode()), "the connection ended before the request's payload"),
    (frame(json.dumps(header()).encode())[:-3], "the request's header is truncated"),
] + [(request_bytes({k: v for k, v in header().items() if k != name}), f"the request header lacks field {name!r}")
     for name in FIELDS]


def test_each_malformed_request_is_refused_with_its_reason_and_the_worker_serves_on(served):
    worker = served(max_header=1 << 20, max_frame=2 << 20)
    for data, reason in MALFORMED:
        head = raw_exchange(worker.path, data)
        assert head is not None and head["ok"] is False, reason  # a reply, not a dropped connection
        assert reason in head["error"] and "\n" not in head["error"]
        worker.assert_serves()
    assert worker.calls == len(MALFORMED)  # only the valid checks reached `handle`
    refused = [line for line in worker.log.getvalue().splitlines() if "refused a request" in line]
    assert len(refused) == len(MALFORMED) and all("hf-fedtask worker: refused a request: " in r for r in refused)
    assert "failed (" not in worker.log.getvalue()  # no connection ended on an unexpected exception


def test_random_bytes_and_truncated_frames_never_end_the_worker(served):
    worker = served(max_header=1 << 20, max_frame=2 << 20)
    rng = random.Random(51)
    whole = request_bytes(header())
    cases = [whole[:rng.randrange(len(whole))] for _ in range(25)]  # prefixes of a valid request
    cases += [rng.randbytes(rng.randrange(1, 80)) for _ in range(25)]  # noise
    cases += [frame(json.dumps(rng.choice([[], 0, "x", None, 1.5, {"round": None}, {"kind": 7}])).encode())
              + frame(b"") + frame(b"") for _ in range(10)]  # JSON of the wrong shape
    for data in cases:
        head = raw_exchange(worker.path, data)
        assert head is not None and head["ok"] is False and "\n" not in head["error"], data
        worker.assert_serves()
    assert worker.calls == len(cases)


def test_noise_before_the_handshake_is_dropped_unanswered(served):
    worker = served()
    rng = random.Random(4)
    for _ in range(10):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(worker.path)
            try:
                s.sendall(rng.randbytes(rng.randrange(1, 300)))
                s.shutdown(socket.SHUT_WR)
                received = b""
                while chunk := s.recv(4096):
                    received += chunk
            except OSError:
                received = b""
            assert b"pong" not in received and b'"ok"' not in received
        worker.assert_serves()
    assert worker.calls == 10
    assert worker.log.getvalue().count("refused a connection that failed the handshake") == 10


def test_a_stalled_connection_neither_blocks_another_client_nor_lives_past_the_timeout(served):
    worker = served(request_timeout=2.0)
    silent = _authenticated(worker.path, worker.path + ".key", 5, "nothing")  # authenticated, then sends nothing
    half = _authenticated(worker.path, worker.path + ".key", 5, "half a frame")
    os.write(half.fileno(), struct.pack("!i", 1000) + b"{\"run")  # half a header, then stalls
    unauthenticated = socket.socket(socket.AF_UNIX)
    unauthenticated.connect(worker.path)  # never answers the challenge
    start = time.monotonic()
    worker.assert_serves()
    assert time.monotonic() - start < 1.5  # answered before any stalled connection timed out
    for conn in (silent, half):
        assert conn.poll(4)
        assert json.loads(conn.recv_bytes()) == {"ok": False, "error": "no complete request within 2 s"}
        conn.recv_bytes(), conn.recv_bytes()
        with pytest.raises(EOFError):
            conn.recv_bytes()  # closed
        conn.close()
    unauthenticated.settimeout(3)
    received = b""
    while chunk := unauthenticated.recv(4096):  # the challenge, then the end of the stream
        received += chunk
    assert received.startswith(b"\0\0\0") and b"#CHALLENGE#" in received
    unauthenticated.close()
    assert time.monotonic() - start < 6
    log = worker.log.getvalue()
    assert log.count("refused a request: no complete request within 2 s; closed the connection") == 2
    assert "refused a connection that failed the handshake (no handshake within 2 s)" in log


def test_the_handling_itself_is_not_timed_and_runs_one_request_at_a_time(served):
    active, most = [0], [0]
    lock = threading.Lock()

    def slow(request):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.8)
        with lock:
            active[0] -= 1
        return pong(request)

    worker = served(slow, request_timeout=0.3)
    results = []
    threads = [threading.Thread(target=lambda: results.append(forward(worker.path, valid_request()).reply))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [b"pong:ping"] * 3 and most[0] == 1  # answered past the 0.3 s request timeout, serially


class FakeListener:
    """Listens on `path` as a worker would (mode 0600) and keeps every byte a ClientApp sends it.
    `play`: 'silent' (reads only), 'challenge' (sends a challenge, accepts any answer, then answers the
    ClientApp's challenge with a guess)."""

    def __init__(self, path: str, play: str):
        self.path, self.play, self.received = path, play, b""
        umask = os.umask(0o177)
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        os.umask(umask)
        self.sock.listen()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            if self.play == "challenge":
                conn.sendall(frame(b"#CHALLENGE#" + os.urandom(20)))
                self._read(conn, 1)
                conn.sendall(frame(b"#WELCOME#"))  # "your digest is fine"
                self._read(conn, 1)  # the ClientApp's challenge
                conn.sendall(frame(os.urandom(16)))  # a guess at its digest
            self._read(conn)

    def _read(self, conn, frames: int | None = None):
        start = len(self.received)
        try:
            while chunk := conn.recv(4096 if frames is None else 1):
                self.received += chunk
                if frames is not None and self._frames(self.received[start:]) >= frames:
                    return
        except OSError:
            pass

    @staticmethod
    def _frames(data: bytes) -> int:
        count = 0
        while len(data) >= 4 and len(data) >= 4 + struct.unpack("!i", data[:4])[0]:
            data, count = data[4 + struct.unpack("!i", data[:4])[0]:], count + 1
        return count

    def assert_learned_nothing(self):
        self.thread.join(5)
        for private in (SECRET, SECRET.hex().encode(), STORE, b"ping"):
            assert private not in self.received

    def close(self):
        self.sock.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


def write_key(path: str, mode: int = 0o600, data: bytes | None = None) -> bytes:
    data = os.urandom(KEY_BYTES) if data is None else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.write(fd, data)
    os.close(fd)
    os.chmod(path, mode)
    return data


@pytest.mark.parametrize("play", ["silent", "challenge"])
def test_an_impostor_without_the_key_is_refused_before_anything_private_is_sent(tmp_path, play):
    path = str(tmp_path / "w.sock")
    fake = FakeListener(path, play)
    try:
        with pytest.raises(WorkerError) as e:
            forward(path, valid_request())  # no key file at all: refused before connecting
        assert str(e.value) == (f"worker key {path}.key does not exist (the worker on {path} writes it when it "
                                f"starts); refusing to send client 3's secret and store")
        assert fake.received == b""
        write_key(path + ".key")  # a key the impostor does not hold
        with pytest.raises(WorkerError, match=f"the listener on {path} failed the handshake with key {path}.key "
                                              r"\((no answer in 0.5 s|AuthenticationError: digest received was wrong)"
                                              r"\); refusing to send client 3's secret and store$") as e:
            forward(path, valid_request(), handshake_timeout=0.5)
        assert "\n" not in str(e.value)
        fake.close()
        fake.assert_learned_nothing()
        assert bool(fake.received) == (play == "challenge")  # the handshake's digests, and nothing more
    finally:
        fake.close()


def test_a_listener_holding_another_key_is_refused(tmp_path):
    path = str(tmp_path / "w.sock")
    write_key(path + ".key")
    umask = os.umask(0o177)
    listener = Listener(path, family="AF_UNIX", authkey=os.urandom(KEY_BYTES))
    os.umask(umask)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(_try_accept(listener)), daemon=True)
    thread.start()
    with pytest.raises(WorkerError, match=r"failed the handshake .*\(AuthenticationError: digest sent was rejected\)"):
        forward(path, valid_request(), handshake_timeout=5)
    thread.join(5)
    listener.close()
    assert accepted == ["AuthenticationError"]


def _try_accept(listener):
    try:
        listener.accept()
        return "accepted"
    except Exception as e:  # noqa: BLE001
        return type(e).__name__


def test_a_workers_socket_with_a_changed_key_is_refused_and_the_worker_logs_it(served):
    worker = served()
    real = open(worker.path + ".key", "rb").read()
    write_key(worker.path + ".key", data=os.urandom(KEY_BYTES))
    with pytest.raises(WorkerError, match="failed the handshake .*AuthenticationError: digest sent was rejected"):
        forward(worker.path, valid_request())
    assert worker.calls == 0
    write_key(worker.path + ".key", data=real)
    worker.assert_serves()
    assert "refused a connection that failed the handshake (AuthenticationError: digest received was wrong)" in \
        worker.log.getvalue()  # logged before the worker accepted the next connection


def test_a_key_or_socket_open_to_others_or_not_a_plain_key_is_refused(served, tmp_path):
    worker = served()
    key = worker.path + ".key"
    refusing = "; refusing to send client 3's secret and store"
    os.chmod(key, 0o644)
    with pytest.raises(WorkerError) as e:
        forward(worker.path, valid_request())
    assert str(e.value) == f"worker key {key} has mode 0644: open to group or others, it must be 0600{refusing}"
    os.chmod(key, 0o600)
    os.chmod(worker.path, 0o666)
    with pytest.raises(WorkerError) as e:
        forward(worker.path, valid_request())
    assert str(e.value) == (f"worker socket {worker.path} has mode 0666: open to group or others, it must be "
                            f"0600{refusing}")
    os.chmod(worker.path, 0o600)
    link = str(tmp_path / "link.key")
    os.symlink(key, link)
    with pytest.raises(WorkerError, match=f"worker key {link}: .*{refusing}$"):
        forward(worker.path, valid_request(), key_file=link)
    short = str(tmp_path / "short.key")
    write_key(short, data=b"k" * 8)
    with pytest.raises(WorkerError, match=f"worker key {short} holds 8 bytes, not the 32 a worker writes{refusing}$"):
        forward(worker.path, valid_request(), key_file=short)
    assert worker.calls == 0
    worker.assert_serves()  # all restored: served again


def test_a_peer_running_as_another_user_is_refused(served, monkeypatch):
    worker = served()
    monkeypatch.setattr(worker_module, "_peer_uid", lambda sock: os.getuid() + 1)
    with pytest.raises(WorkerError, match=f"the process listening on {worker.path} runs as uid {os.getuid() + 1}, "
                                          rf"not as this user \(uid {os.getuid()}\); refusing"):
        forward(worker.path, valid_request())
    monkeypatch.undo()
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert worker_module._peer_uid(a) == (os.getuid() if hasattr(socket, "SO_PEERCRED") else None)
    worker.assert_serves()


def test_the_worker_writes_a_private_key_before_listening_and_removes_both_when_it_stops(tmp_path):
    path = str(tmp_path / "w.sock")
    write_key(path + ".key")  # a dead worker's key: replaced
    stale = open(path + ".key", "rb").read()
    worker = Worker(path)
    worker.open()
    st = os.stat(path + ".key")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == KEY_BYTES and st.st_uid == os.getuid()
    assert open(path + ".key", "rb").read() != stale
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(WorkerError, match=f"worker key {path}.key belongs to a running worker; give each worker its "
                                          "own --authkey-file"):
        Worker(tmp_path / "other.sock", authkey_file=path + ".key").open()  # another worker, the same key file
    assert not (tmp_path / "other.sock").exists()
    worker.close()
    assert not os.path.exists(path) and not os.path.exists(path + ".key")


def test_a_key_file_that_is_no_workers_key_is_left_alone(tmp_path):
    path = str(tmp_path / "w.sock")
    for data, mode in ((b"my notes", 0o600), (os.urandom(KEY_BYTES), 0o644)):
        write_key(path + ".key", mode=mode, data=data)
        with pytest.raises(WorkerError, match=f"worker key {path}.key exists and is not a stale worker key"):
            Worker(path).open()
        assert open(path + ".key", "rb").read() == data and not os.path.exists(path)


def test_a_key_file_named_in_the_node_config_is_the_one_used(tmp_path, served):
    from hf_fedtask.engine.flower.worker import worker_key_file

    assert worker_key_file({}, "/run/w.sock") == "/run/w.sock.key"
    assert worker_key_file({"worker-key": "/keys/w.key"}, "/run/w.sock") == "/keys/w.key"
    with pytest.raises(WorkerError, match="node config worker-key=3: expected the worker's key file"):
        worker_key_file({"worker-key": 3}, "/run/w.sock")
    key = tmp_path / "elsewhere.key"
    worker = served(authkey_file=key)
    assert key.exists() and not os.path.exists(worker.path + ".key")
    assert forward(worker.path, valid_request(), key_file=str(key)).reply == b"pong:ping"


def _read_frame(conn: socket.socket) -> bytes:
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack("!i", data[:4])[0]:
        chunk = conn.recv(1)
        if not chunk:
            raise EOFError
        data += chunk
    return data[4:]


def test_an_impostor_cannot_reflect_one_clientapps_answer_to_another(tmp_path):
    """An impostor at the socket path (without the key) passes ClientApp A's challenge on to ClientApp B as
    its own and hands B's answer back to A: A must still refuse, as each direction has its own key."""
    path = str(tmp_path / "w.sock")
    write_key(path + ".key")
    fake = FakeListener.__new__(FakeListener)  # its socket and its bookkeeping, with this relay as its play
    fake.path, fake.received = path, b""
    umask = os.umask(0o177)
    fake.sock = socket.socket(socket.AF_UNIX)
    fake.sock.bind(path)
    os.umask(umask)
    fake.sock.listen()
    errors = {}

    def client(name):
        try:
            forward(path, valid_request(), handshake_timeout=5)
            errors[name] = None
        except WorkerError as e:
            errors[name] = str(e)

    def relay():
        a, _ = fake.sock.accept()
        with a:
            a.sendall(frame(b"#CHALLENGE#" + os.urandom(20)))
            _read_frame(a)  # A's answer to a challenge of ours: useless without the key
            a.sendall(frame(b"#WELCOME#"))
            challenge_of_a = _read_frame(a)
            threading.Thread(target=client, args=("b",), daemon=True).start()
            b, _ = fake.sock.accept()
            with b:
                b.sendall(frame(challenge_of_a))  # A's challenge, put to B
                answer_of_b = _read_frame(b)
                b.sendall(frame(b"#WELCOME#"))
            a.sendall(frame(answer_of_b))  # ... and B's answer handed to A
            a.settimeout(5)
            while chunk := a.recv(4096):  # whatever A sends now
                fake.received += chunk

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    client("a")
    thread.join(10)
    fake.sock.close()
    assert "failed the handshake" in errors["a"] and "digest received was wrong" in errors["a"]
    assert SECRET not in fake.received and SECRET.hex().encode() not in fake.received and STORE not in fake.received
