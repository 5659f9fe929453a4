"""The request a SuperNode's ClientApp forwards to its warm worker, and the result it gets back.

`ClientRequest` is one message for a client as its ClientApp received it; `ClientResult` the reply's bytes
and the client's store afterwards. Framing is `multiprocessing.connection`'s (length-prefixed byte
messages; nothing is pickled): a JSON header, then the payload, then the store. A worker reads a request
with `ClientRequest.receive`, which checks every header field (`FIELDS`) and frame size before use and
answers anything malformed with a one-line `WorkerError`.

Both sides of the socket (`hf_fedtask.engine.flower.worker`) and the client half that answers a request
(`hf_fedtask.engine.flower.handler`) build on this module.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from multiprocessing.connection import Connection

from hf_fedtask.core.kinds import KINDS
from hf_fedtask.engine.messages import Instruction
from hf_fedtask.errors import WorkerError

MIB, GIB = 1 << 20, 1 << 30
MAX_HEADER = 16 * MIB  # the JSON header holds the run config: generous, yet far below a payload
MAX_FRAME = 4 * GIB  # the payload and the store: a full model's vectors fit
SECRET_HEX = re.compile(r"[0-9a-fA-F]{64}")  # the node's 32-byte secret (`node.node_secret`)


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
    def receive(cls, conn: Connection, max_header: int = MAX_HEADER, max_frame: int = MAX_FRAME) -> ClientRequest:
        """Read and validate one request; anything malformed is a one-line `WorkerError` naming what."""
        raw = _recv(conn, "header", max_header)
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise WorkerError(f"the request header is not JSON ({type(e).__name__}: {one_line(e)})") from None
        if not isinstance(header, dict):
            raise WorkerError(f"the request header is {_json_type(header)}, expected a JSON object")
        unknown = sorted(set(header) - set(FIELDS))
        if unknown:
            raise WorkerError(f"the request header has unknown field(s) {', '.join(map(repr, unknown))}")
        for name, (valid, expected) in FIELDS.items():
            if name not in header:
                raise WorkerError(f"the request header lacks field {name!r} ({expected})")
            if not valid(header[name]):
                raise WorkerError(f"the request header's {name!r} is {_json_value(header[name])}, expected {expected}")
        payload = _recv(conn, "payload", max_frame)
        store = _recv(conn, "store", max_frame)
        if store and not header["store"]:
            raise WorkerError(f"the request header says store=false, but a store of {len(store)} bytes follows")
        ins = Instruction(header["kind"], header["round"], header["client_id"], payload, header["config"])
        return cls(header["run_config"], header["client"], bytes.fromhex(header["secret"]), ins,
                   store if header["store"] else None)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


FIELDS = {  # every header field: its check, and what it must be (for the error line)
    "run_config": (lambda v: isinstance(v, dict), "a JSON object"),
    "client": (lambda v: _int(v) and v >= 0, "an int >= 0"),
    "secret": (lambda v: isinstance(v, str) and SECRET_HEX.fullmatch(v) is not None, "64 hex digits (32 bytes)"),
    "kind": (lambda v: isinstance(v, str) and v in KINDS, f"one of {', '.join(KINDS)}"),
    "round": (lambda v: _int(v) and v >= 0, "an int >= 0"),
    "client_id": (_int, "an int"),
    "config": (lambda v: isinstance(v, dict), "a JSON object"),
    "store": (lambda v: isinstance(v, bool), "true or false"),
}


@dataclass
class ClientResult:
    """The reply's bytes and the client's store afterwards (packed), to keep in the node's state."""

    reply: bytes
    store: bytes


def _recv(conn: Connection, what: str, limit: int) -> bytes:
    try:
        return conn.recv_bytes(limit)
    except EOFError:
        raise WorkerError(f"the connection ended before the request's {what}") from None
    except OSError as e:
        if str(e) == "bad message length":  # multiprocessing.connection's word for a frame over `limit`
            raise WorkerError(f"the request's {what} is longer than {limit} bytes") from None
        raise WorkerError(f"the request's {what} is truncated ({one_line(e)})") from None


def one_line(error: BaseException | str) -> str:
    return " ".join(str(error).split())[:2000]


def _json_type(value) -> str:
    return {dict: "a JSON object", list: "a JSON array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _json_value(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{_json_type(value)} ({text[:30]}...)"
